"""The seed-004 prototype API (the early ``torchCompressor`` / ``tfCompressor`` namespaces), kept working as thin
adapters onto the modern classes: :mod:`.prototype` (framework-free), :mod:`.prototype_torch`,
:mod:`.prototype_tf`. Users import them as ``compressor.torchCompressor`` / ``compressor.tfCompressor`` (the
shims at the package root); nothing else in the library imports this package. Importing it imports nothing
else, so each namespace loads only its own framework.
"""
