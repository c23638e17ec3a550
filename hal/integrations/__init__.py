"""Adapters that plug lockstep's ops into other libraries (transformers, ...). Each imports its library lazily."""
