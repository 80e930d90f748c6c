"""Every error shadowgba raises, in one hierarchy, so a job can catch "the sync failed" in one place.

    ShadowGBAError                  base: anything the library raises on purpose
    ├── ConfigError (ValueError)    a config key or value that cannot run; names the dotted key
    ├── SetupError (ValueError)     a job that cannot be wired up (a DMP over the server ranks, an
    │                               optimizer the algorithm cannot mirror ...); names the fix
    ├── CheckpointError (ValueError) a state that does not fit this job; nothing was changed
    ├── BatchError (ValueError)     a training batch the tables cannot take (lengths, ids, features);
    │                               names the trainer, the feature and what is wrong
    └── SyncError                   a round, push or collective failed while running; the cause is
        └── PeerLost                chained (`__cause__`) and the local weights are intact
            │                       a peer rank failed or stopped answering; names the rank
            └── ServerRestarted     a server came back as a new process, restored from its checkpoint,
                                    while a call to it was in flight (the call was not run again)

Errors raised while the library cleans up after the *user's* exception never replace it: they are
logged and attached to it as notes (`DenseSync.__exit__`).
"""

from __future__ import annotations

from typing import Sequence


class ShadowGBAError(RuntimeError):
    """Base of every error shadowgba raises on purpose."""


class ConfigError(ShadowGBAError, ValueError):
    """A configuration that cannot be used; the message names the key and the allowed values."""


class SetupError(ShadowGBAError, ValueError):
    """A job that cannot be wired up as given; the message names what to change."""


class CheckpointError(ShadowGBAError, ValueError):
    """A state that does not fit this job (another algorithm, layout or world size); nothing changed."""


class BatchError(ShadowGBAError, ValueError):
    """A batch refused by the trainer that got it, before TorchRec sees it; the message names the key."""


class SyncError(ShadowGBAError):
    """Synchronization failed while running; the cause is chained and the local weights are intact.
    `ranks`: the global ranks whose failure this is, when known (a round's NaN flags, a lost peer),
    which every rank's report names as the cause (`shadowgba.job.blame`)."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class PeerLost(SyncError):
    """A peer rank (trainer or server) failed or stopped answering; the message names it (`ranks`,
    when it is known by rank), and what the transport said is its cause (`__cause__`)."""


class ServerRestarted(PeerLost):
    """A server process was replaced by a new one, restored from the servers' own checkpoint, while a
    call to it was in flight: the call is not sent again (the new process holds older state); the
    caller re-reads what it holds from the server (`GBAClient`, `PSEmbeddingBagCollection`)."""
