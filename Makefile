.PHONY: demo test lint
demo:
	bash scripts/demo.sh
test:
	bash scripts/test.sh
lint:
	ruff check compressor tests examples benchmarks
