"""A sum over ranks of a flat fp32 payload in fewer bytes (`sync.compress: bf16 | int8`).

What a round sends where bandwidth is finite: a ring all-reduce of an fp32 vector of m values sends
about 2 x 4m bytes per rank. Here a rank sends 2 bytes (bf16) or 1 byte and a per-block scale
(int8) per value, twice:

1. *reduce-scatter by all-to-all*: the payload is cut into one chunk per rank; each rank sends chunk
   j, quantized, to rank j;
2. each rank dequantizes the chunks it received and **sums them in fp32** (the sum of n low-precision
   values in low precision would lose what the quantization kept);
3. *all-gather*: each rank quantizes its summed chunk and every rank receives every chunk, so every
   rank ends with the same bytes: the replicas' consensus stays identical on every rank.

**Error feedback.** What quantizing a rank's contribution left out (`x - q(x)`, with `x` the payload
plus the residual carried from the last call) is kept in `residual` and added to its next
contribution, so nothing a rank sends is lost for good, only delayed (Seide et al. 2014; the same
rule as torch's PowerSGD hook and torchft's quantized all-reduce). A contribution left out of the
round (NaN / Inf) is sent as zeros and its residual is left as it was.

Quantizing weights themselves would cost ~0.4% of every weight per round in bf16: what callers sum
are *differences* (a snapshot minus a reference every rank holds, `SyncAlgorithm.average`; EASGD's
pulls), whose rounding error is that fraction of the difference only.

int8 is symmetric per block of `BLOCK` values: scale = max |x| / 127 of the block, sent as fp32
beside the values (4 / BLOCK bytes per value).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

COMPRESSIONS = ("none", "bf16", "int8")
"""What `sync.compress` may name."""
BLOCK = 256
"""int8: values per scale."""
_LEVELS = 127.0


def _all_gather(output: torch.Tensor, chunk: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name where it exists
    gather(output, chunk, group=group)


class CompressedSum:
    """`sum_(payload)`: payload <- sum over the group's ranks, each contribution quantized to `kind`
    with error feedback, the sums in fp32 (see the module docstring). Buffers are allocated once."""

    def __init__(self, kind: str, group: dist.ProcessGroup | None, numel: int, ranks: int, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        """A sum of `numel` values of `dtype` (the payload's: the residual and the sums are kept in
        it) over the `ranks` ranks of `group`."""
        if kind not in COMPRESSIONS[1:]:
            raise ValueError(f"compress must be one of {list(COMPRESSIONS[1:])} here, got {kind!r}")
        self.kind = kind
        self.group = group
        self.numel = numel
        self.ranks = ranks
        block = BLOCK if kind == "int8" else 1
        self.chunk = -(-numel // (ranks * block)) * block  # a whole number of blocks per rank
        padded = self.chunk * ranks
        self.residual = torch.zeros(padded, dtype=dtype, device=device)
        """What rounding left out of this rank's contributions so far (error feedback)."""
        self._work = torch.zeros(padded, dtype=dtype, device=device)
        wire = torch.bfloat16 if kind == "bf16" else torch.int8
        self._send, self._received, self._gathered = (torch.zeros(padded, dtype=wire, device=device) for _ in range(3))
        blocks = padded // block
        self._scales = [torch.zeros(blocks, dtype=dtype, device=device) for _ in range(3)] if kind == "int8" else []

    @property
    def bytes_per_call(self) -> int:
        """The payload's size as sent (values and int8's scales), on the basis `FlaggedAllReduce`
        counts an fp32 payload: what one all-reduce moves per rank is a small multiple of it in
        either case (about 2x for a ring, and for the two phases here)."""
        per_value = self._send.element_size() + (self._scales[0].element_size() / BLOCK if self._scales else 0)
        return int(self.chunk * self.ranks * per_value)

    def sum_(self, payload: torch.Tensor, contributes: bool) -> None:
        """payload <- the sum of every rank's payload, in place; `contributes` False: this rank's
        counts as zeros (left out: NaN / Inf) and its residual stays as it was."""
        work, n = self._work, self.numel
        if contributes:
            torch.add(payload, self.residual[:n], out=work[:n])
            work[n:].zero_()
            self._quantize(work, self._send, 0)
            self.residual.copy_(work).sub_(self._dequantize(self._send, 0, out=self._work))  # x - q(x)
        else:
            self._send.zero_()
            if self._scales:
                self._scales[0].fill_(0.0)
        self._exchange(self._send, self._received, lambda out, inp: dist.all_to_all_single(out, inp, group=self.group))
        owned = self._dequantize(self._received, 1, out=self._work).view(self.ranks, self.chunk).sum(0)
        self._quantize(owned, self._send[: self.chunk], 0)
        self._exchange(self._send[: self.chunk], self._gathered, lambda out, inp: _all_gather(out, inp, self.group),
                       gather=True)
        payload.copy_(self._dequantize(self._gathered, 2, out=self._work)[:n])

    def _exchange(self, send: torch.Tensor, receive: torch.Tensor,
                  collective: Callable[[torch.Tensor, torch.Tensor], Any], gather: bool = False) -> None:
        """One phase: `collective(receive, send)`, and int8's scales beside the values (from scales 0,
        where `_quantize` put them; the all-to-all's into scales 1, the all-gather's into scales 2)."""
        collective(receive, send)
        if self._scales:
            collective(self._scales[2 if gather else 1], self._scales[0][: send.numel() // BLOCK])

    def _quantize(self, values: torch.Tensor, out: torch.Tensor, scales: int) -> None:
        if self.kind == "bf16":
            out.copy_(values)
            return
        blocks = values.view(-1, BLOCK)
        scale = self._scales[scales][: blocks.shape[0]]
        torch.amax(blocks.abs(), dim=1, out=scale)
        scale.div_(_LEVELS).clamp_(min=torch.finfo(scale.dtype).tiny)
        out.view(-1, BLOCK).copy_(torch.round(blocks / scale[:, None]))

    def _dequantize(self, values: torch.Tensor, scales: int, out: torch.Tensor) -> torch.Tensor:
        result = out[: values.numel()]
        if self.kind == "bf16":
            return result.copy_(values)
        scale = self._scales[scales][: values.numel() // BLOCK]
        return result.view(-1, BLOCK).copy_(values.view(-1, BLOCK)).mul_(scale[:, None]).view(-1)
