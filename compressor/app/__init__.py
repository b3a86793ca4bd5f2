"""The compressor application, built on the library: the ``compressor`` command line (:mod:`.cli`), the report
of exported model files (:mod:`.report`), the demos (:mod:`.demo`, :mod:`.demo_lm`, with one training harness
per backend: :mod:`.demo_torch` / :mod:`.demo_tf`, :mod:`.demo_lm_torch` / :mod:`.demo_lm_tf`) and their data
sets (:mod:`.data`).

The application imports the library; nothing in the library imports the application
(``tests/core/test_architecture.py``). Importing this package imports nothing else.
"""
