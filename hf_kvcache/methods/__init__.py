"""One module per method: a thin policy (codecs, window, sink) over `hf_kvcache.cache`."""
