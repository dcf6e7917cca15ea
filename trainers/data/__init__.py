"""Data: dataset formats and the chat renderer, the data order (samplers), streams, packing items into bins."""
