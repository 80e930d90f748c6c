"""GBA and its synchronous twin, trainer and server, along their seams:

- `runtime.py`: `GBASync`, the `DenseSync` of `sync.algo: gba`; the mode state machine (`Mode`)
  and the switch and close protocols;
- `allreduce.py`: sync mode's one all-reduce per step and its buffer layout;
- `client.py`: GBA mode's asynchronous client (bounded queue, pusher and watcher threads);
- `shards.py`: the dense shards' messages and their typed trainer side, `DenseShardClient`;
- `server.py`: a parameter-server rank's dense shard (`DenseShard`, `serve_dense_shard`);
- `config.py`: the `sync.gba` section (`GBAConfig`); `switch_policy.py`: automatic switching.

The package imports `shadowgba.ps` (the transport the shards are served over, server checkpoints)
and `shadowgba.job` (roles, the servers' roster), never the other way round. Import the modules themselves
(`from shadowgba.gba.runtime import GBASync`): this file imports nothing, so that reading the
`sync.gba` section (`shadowgba.config`) does not load the runtime.
"""
