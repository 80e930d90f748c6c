"""GBA and its synchronous twin on a trainer, along its seams:

- `runtime.py`: `GBASync`, the `DenseSync` of `sync.algo: gba`; the mode state machine (`Mode`)
  and the switch and close protocols;
- `allreduce.py`: sync mode's one all-reduce per step and its buffer layout;
- `client.py`: GBA mode's asynchronous client (bounded queue, pusher and watcher threads);
- `config.py`: the `sync.gba` section (`GBAConfig`); `switch_policy.py`: automatic switching.

The server side is `shadowgba.ps.dense_server` (`DenseShard`, its typed client `DenseShardClient`,
`serve_dense_shard`).

`from shadowgba.gba import GBASync, serve_dense_shard` loads the runtime on first use: importing it
here at once would be an import cycle, since `dense_server` imports this package's `config`.
"""

from __future__ import annotations

from typing import Any

_RUNTIME_NAMES = ("GBASync", "Mode", "serve_dense_shard")


def __getattr__(name: str) -> Any:
    if name in _RUNTIME_NAMES:
        from shadowgba.gba import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'shadowgba.gba' has no attribute '{name}'")


__all__ = list(_RUNTIME_NAMES)
