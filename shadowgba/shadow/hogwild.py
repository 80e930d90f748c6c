"""Hogwild training threads: several threads train one local model lock-free, as in ShadowSync.

One module shared by several threads fails: its parameters' autograd version counters and `.grad`
are shared, so one thread's optimizer step invalidates another's saved tensors mid-backward
("modified by an inplace operation"). What works (docs/design.md, "Write-back"): one module *replica* per thread
whose parameters share storage with the original (`nn.Parameter(p.data)` shares the memory but has
its own version counter and its own `.grad`), and one optimizer per thread. Updates then race on
the shared memory, which is Hogwild's contract. The shadow runtime syncs the original module's
parameters, i.e. the shared storage, and takes every thread's optimizer as a step boundary.

Only for models whose embeddings are local: a TorchRec-sharded model's all-to-all cannot be
entered by several threads at once.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable

from torch import nn

from shadowgba.errors import ConfigError


def shared_replicas(module: nn.Module, count: int) -> list[nn.Module]:
    """`count` modules: `module` itself, then copies whose parameters share its storage."""
    if count < 1:
        raise ConfigError(f"count must be >= 1, got {count}")
    replicas = [module]
    for _ in range(count - 1):
        replica = copy.deepcopy(module)
        for name, param in module.named_parameters():
            owner_name, _, leaf = name.rpartition(".")
            owner = replica.get_submodule(owner_name)
            setattr(owner, leaf, nn.Parameter(param.data, requires_grad=param.requires_grad))
        replicas.append(replica)
    return replicas


class HogwildThreads:
    """Runs one training loop per replica in its own thread and re-raises the first failure.

    `optimizer_factory(replica)` builds each thread's optimizer; pass `optimizers` to `ShadowSync`
    so every thread's step is a step boundary.
    """

    def __init__(
        self, module: nn.Module, num_threads: int, optimizer_factory: Callable[[nn.Module], Any]
    ) -> None:
        self.replicas = shared_replicas(module, num_threads)
        self.optimizers = [optimizer_factory(replica) for replica in self.replicas]

    def run(self, train: Callable[[int, nn.Module, Any], None]) -> None:
        """Call `train(thread_index, replica, optimizer)` in each thread; wait for all to finish."""
        errors: list[BaseException] = []

        def target(index: int) -> None:
            try:
                train(index, self.replicas[index], self.optimizers[index])
            except BaseException as error:
                errors.append(error)

        threads = [
            threading.Thread(target=target, args=(index,), name=f"shadowgba-hogwild-{index}")
            for index in range(len(self.replicas))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:  # the user's exception wins, as in a `with` block of one thread
            if len(errors) > 1:
                errors[0].add_note(f"shadowgba: {len(errors)} Hogwild training threads failed; this is the first one's error")
            raise errors[0]
