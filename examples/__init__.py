"""Runnable examples: paper reproductions on MNIST for both backends (run from the repository root as
``python -m examples.reproduce_han2015`` etc.; see RESULTS.md). Not part of the installed package."""
