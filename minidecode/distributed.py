"""One model over several processes (one per GPU, or CPU processes with gloo), launched by torchrun.

- the process group, set up from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK): NCCL on
  GPUs, gloo on CPUs, with NVLink multicast forced off in every process;
- each rank's share of the model is models/sharding.py's (ShardPlan: tensor parallel (tp) splits
  the query and KV heads, the MLP's intermediate rows and the vocabulary; context parallel (cp)
  deals the context's positions over the ranks, `deal`);
- the collectives the model calls (models/sharding.py's Collectives; the exact log-sum-exp merge
  of attention computed over disjoint sets of the context's positions is kernels/ops.py's); on GPUs, the
  small ones of the decode step run as one-shot kernels over symmetric memory (OneShot), the rest
  through NCCL;
- agreement between ranks: one rank's error becomes every rank's, so all exit together;
- the plan group (gloo, with a timeout) over which rank 0 sends each step plan to the other ranks
  (fanout.py).

Ranks are laid out tp-major: global rank = cp_rank * tp + tp_rank. A tensor-parallel group is the
tp ranks of one cp_rank (they hold the same positions); a context-parallel group is the cp ranks of
one tp_rank (they hold the same heads).
"""

from __future__ import annotations

import atexit
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import UserError
from .kernels import ops
from .kernels.fp8_weights import FP8Weight, QuantizedRows
from .validate import check_parallel

# NVLink multicast (NVLS) stays off on the machines this runs on: forced in every process before the
# process group starts (a value inherited from the launcher's environment is overridden). Symmetric
# memory uses PyTorch's CUDA backend: peer-to-peer mappings of each rank's buffer, no NVSHMEM.
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "TORCH_SYMMMEM": "CUDA",
}
# The decode step's small collectives (a [1, hidden] all-reduce is 8 KiB for an 8B model, 16 KiB
# for 70B; the context-parallel merge gathers 16.5 KiB a rank, the logits 251 KiB in all) run as
# one-shot kernels (OneShot) up to collectives.MAX_BYTES (512 KiB) a rank; larger ones (prefill's
# activations) go through NCCL, whose ring and tree algorithms move large messages at link bandwidth.


def world_size_from_environment() -> int | None:
    """torchrun's WORLD_SIZE, or None outside torchrun."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


@dataclass
class Parallel:
    """This process's place among tp x cp ranks, and the collectives over its groups (the ones the
    model calls are models/sharding.py's Collectives, which this class is)."""

    tp: int
    cp: int
    rank: int
    device: torch.device
    tp_group: Any = None  # ProcessGroup of this rank's tensor-parallel peers (None when tp == 1)
    cp_group: Any = None  # ProcessGroup of this rank's context-parallel peers (None when cp == 1)
    # Symmetric-memory one-shot collectives over each group (GPUs whose ranks all map each other's
    # memory; None: NCCL only), and whether small collectives use them (False: NCCL for all, the
    # peer that bench/distributed.py times them against; a captured decode graph keeps what it was
    # captured with: release it after a change). one_shot_problem: why they are off.
    tp_one_shot: OneShot | None = None
    cp_one_shot: OneShot | None = None
    use_one_shot: bool = True
    one_shot_problem: str | None = None
    plan_group: Any = None  # gloo ProcessGroup of every rank for rank 0's step plans (fanout.py)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return self.rank // self.tp

    def cp_peer(self, cp_rank: int) -> int:
        """The global rank of context-parallel rank `cp_rank` that holds this rank's heads."""
        return cp_rank * self.tp + self.tp_rank

    # ---- collectives over model tensors (ordered on the current stream: graph-capturable) ------
    def one_shot_tp(self, x: torch.Tensor) -> OneShot | None:
        """The tensor-parallel group's one-shot collectives if they take x, else None: NCCL."""
        return self._one_shot(self.tp_one_shot, x)

    def all_reduce_tp(self, x: torch.Tensor) -> None:
        """x += every tensor-parallel peer's x, in place (the row-split projections' sum)."""
        if (one_shot := self.one_shot_tp(x)) is not None:
            one_shot.sum(x, out=x)
        else:
            dist.all_reduce(x, group=self.tp_group)

    def all_gather_tp(self, x: torch.Tensor) -> torch.Tensor:
        """[tp, *x.shape]: every tensor-parallel rank's x, in tp-rank order."""
        if (one_shot := self.one_shot_tp(x)) is not None:
            return one_shot.gather(x)
        return _all_gather(x, self.tp, self.tp_group)

    def all_gather_cp(self, x: torch.Tensor) -> torch.Tensor:
        """[cp, *x.shape]: every context-parallel rank's x, in cp-rank order."""
        if (one_shot := self._one_shot(self.cp_one_shot, x)) is not None:
            return one_shot.gather(x)
        return _all_gather(x, self.cp, self.cp_group)

    def _one_shot(self, one_shot: OneShot | None, x: torch.Tensor) -> OneShot | None:
        return one_shot if self.use_one_shot and one_shot is not None and one_shot.fits(x) else None

    def broadcast_cp(self, x: torch.Tensor, cp_rank: int) -> None:
        """x (contiguous) := the x of context-parallel rank cp_rank, in place on every peer."""
        dist.broadcast(x, src=self.cp_peer(cp_rank), group=self.cp_group)

    # ---- agreement (host objects, default group) ----------------------------------------------
    def first_error(self, message: str | None) -> str | None:
        """Every rank's error (None: none), gathered: the first one, named by its rank where not
        every rank had it; the same answer on every rank."""
        messages: list[str | None] = [None] * self.world_size
        dist.all_gather_object(messages, message)
        errors = [(r, m) for r, m in enumerate(messages) if m is not None]
        if not errors:
            return None
        rank, first = errors[0]
        return first if len(errors) == self.world_size else f"rank {rank}: {first}"

    def check_same(self, **settings: Any) -> None:
        """Refuse ranks started with different settings (a launcher that passes each rank its
        own arguments, or a script that differs per rank)."""
        every: list[dict | None] = [None] * self.world_size
        dist.all_gather_object(every, settings)
        for rank, theirs in enumerate(every):
            if theirs != every[0]:
                differ = ", ".join(f"{k} {every[0][k]!r} on rank 0 but {theirs[k]!r}" for k in settings
                                   if theirs.get(k) != every[0].get(k))  # fmt: skip
                raise UserError(f"the ranks were started differently: {differ} on rank {rank}")


def _all_gather(x: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
    gather(out, x.contiguous(), group=group)
    return out.view(n, *x.shape)


class OneShot:
    """Small collectives over one process group as single Triton kernels over symmetric memory
    (kernels/collectives.py: each rank pushes its part, as words tagged with the call's count, into
    every peer's buffer over NVLink, then polls its own buffer until the peers' words of this call
    are there: one one-way trip a call, and the next kernel launches while the words travel).
    PyTorch's symm_mem allocates the buffers and maps every peer's into each process (a collective
    rendezvous, once); no multicast. Every rank sums in rank order in float32, so the sum is the
    same bit for bit on every rank."""

    def __init__(self, group: Any, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        from .kernels import collectives  # here, not at the top: CPU ranks (gloo) never import triton

        self.group_name, self.size, self.rank = group.group_name, group.size(), group.rank()
        self.device = device
        if self.size > collectives.MAX_RANKS:
            raise ValueError(f"one-shot collectives take up to {collectives.MAX_RANKS} ranks")
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older PyTorch, deprecated later
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(collectives.buffer_bytes(self.size), dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, self.group_name)
        offset = getattr(handle, "offset", 0)  # where the tensor starts in its allocation (newer PyTorch)
        addresses = [int(p) + offset for p in handle.buffer_ptrs]
        self.ends = collectives.RankBuffers.of(self.buffer, addresses, self.rank)
        self.collectives = collectives
        self.use_pdl = torch.cuda.get_device_capability(device)[0] >= 9
        self.buffer.zero_()  # no word carries a tag before any peer pushes one
        dist.all_reduce(torch.zeros(1, device=device), group=group)  # after every rank's zeroing
        torch.cuda.synchronize(device)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether the kernel takes x: on this device, contiguous, bf16 / fp16 / fp32, whole 4-byte
        words, <= 512 KiB."""
        return x.device == self.device and self.collectives.fits(x)

    def can_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether sum() can also normalise x's sum (RMSNorm with `weight`): one row, in one CTA."""
        return x.shape[0] == 1 and self.collectives.fits_one_chunk(x) and weight.dtype == x.dtype

    def sum(
        self, x: torch.Tensor, out: torch.Tensor, norm: tuple[torch.Tensor, float, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """out := the sum of every rank's x (out may be x); norm = (weight, eps, normed): also that
        sum's RMSNorm into normed (where can_norm)."""
        return self.collectives.one_shot(x, out, self.ends, False, self.use_pdl, norm)

    def sum_of_linear(
        self,
        x: torch.Tensor | QuantizedRows,
        weight: torch.Tensor | FP8Weight,
        bias: torch.Tensor | None,
        out: torch.Tensor,
        residual: torch.Tensor | None = None,
        norm: tuple[torch.Tensor, float, torch.Tensor] | None = None,
        pdl: bool = False,
    ) -> None:
        """out := the sum over the group of every rank's linear(x) (+ residual: added into it in
        place first), and with norm its RMSNorm, as sum's: in the GEMV's own launch where it takes
        x (ops.linear_summed)."""
        summed = self.collectives.SumAfter(self.ends, out, norm)
        ops.linear_summed(x, weight, bias, summed, residual=residual, pdl=pdl)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x, in group-rank order."""
        out = torch.empty(self.size, *x.shape, dtype=x.dtype, device=x.device)
        return self.collectives.one_shot(x, out, self.ends, True, self.use_pdl)


def init_parallel(tp: int, cp: int, device: str | torch.device | None, one_shot: bool = True) -> Parallel:
    """The process group from torchrun's environment (started here unless the script did), and
    this rank's groups and device: cuda:LOCAL_RANK with NCCL, or the CPU with gloo. one_shot: set up
    the symmetric-memory collectives where the GPUs allow (False: NCCL only)."""
    world = world_size_from_environment()
    check_parallel(tp, cp, world)
    dev = _rank_device(device)
    os.environ.update(NO_MULTICAST)
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, **kwargs)
        # Ended before the interpreter's own teardown: a process group left to it aborts the
        # process ("terminate called without an active exception"), a failure after the work.
        atexit.register(_end_process_group)
    if dist.get_world_size() != tp * cp:
        raise UserError(
            f"the process group has {dist.get_world_size()} ranks but tp {tp} x cp {cp} = {tp * cp}"
        )
    parallel = Parallel(tp, cp, dist.get_rank(), dev)
    # Every rank creates every group, in the same order (new_group is collective).
    for c in range(cp):
        group = dist.new_group([c * tp + t for t in range(tp)]) if tp > 1 else None
        if c == parallel.cp_rank:
            parallel.tp_group = group
    for t in range(tp):
        group = dist.new_group([c * tp + t for c in range(cp)]) if cp > 1 else None
        if t == parallel.tp_rank:
            parallel.cp_group = group
    from .fanout import plan_timeout

    # host objects over gloo, with a timeout: a dead rank ends the others' waits (fanout.py)
    parallel.plan_group = dist.new_group(list(range(tp * cp)), backend="gloo", timeout=plan_timeout())
    parallel.check_same(tp=tp, cp=cp, device=dev.type, one_shot=one_shot)
    if one_shot:
        _set_up_one_shot(parallel)
    return parallel


def _set_up_one_shot(parallel: Parallel) -> None:
    """The symmetric-memory buffers of this rank's groups, where every rank can have them; else
    (any rank's problem, agreed by all, so that no rank waits in a collective the others skip)
    NCCL only, the reason kept in parallel.one_shot_problem."""
    problem = _one_shot_problem(parallel)
    if (problem := parallel.first_error(problem)) is None:
        try:  # tp groups first on every rank, then cp groups: each rendezvous is collective
            if parallel.tp > 1:
                parallel.tp_one_shot = OneShot(parallel.tp_group, parallel.device)
            if parallel.cp > 1:
                parallel.cp_one_shot = OneShot(parallel.cp_group, parallel.device)
        except Exception as e:  # an older PyTorch, a driver without peer mappings: NCCL still works
            reason = str(e).strip()
            problem = f"symmetric memory: {reason.splitlines()[0] if reason else type(e).__name__}"
        problem = parallel.first_error(problem)
    if problem is not None:
        parallel.tp_one_shot = parallel.cp_one_shot = None
    parallel.one_shot_problem = problem


def _one_shot_problem(parallel: Parallel) -> str | None:
    """Why this rank cannot take part in the one-shot collectives (None: it can)."""
    if parallel.device.type != "cuda":
        return "CPU ranks (gloo)"
    world = parallel.world_size
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        return "ranks on several hosts (symmetric memory maps GPUs of one host)"
    mine = parallel.device.index
    peers = [d for d in range(min(world, torch.cuda.device_count())) if d != mine]
    if any(not torch.cuda.can_device_access_peer(mine, d) for d in peers):
        return f"GPU {mine} cannot map the memory of every peer GPU"
    return None


def _end_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_device(device: str | torch.device | None) -> torch.device:
    """Each rank's device: the GPU of its LOCAL_RANK (for None or "cuda"), or the CPU."""
    dev = torch.device(device) if device is not None else None
    if dev is None:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda":
        return dev
    if dev.index is not None:
        raise UserError(
            f"with --tp / --cp each rank uses the GPU of its local rank: give --device cuda, not {device}"
        )
    if not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for but no CUDA GPU is available")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise UserError(f"local rank {local} has no GPU: this machine has {torch.cuda.device_count()}")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)
