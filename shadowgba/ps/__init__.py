"""Parameter-server side of shadowgba: transport, dense GBA shards and asynchronous embeddings."""
