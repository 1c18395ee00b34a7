"""ModelRunner: SchedulerOutput -> one forward pass over the flat batch -> ModelRunnerOutput.

Owns the model, the paged KV cache tensors, the per-request input state (updated by the
scheduler's diffs) and the per-request sampling state. On a GPU, decode-only steps replay CUDA
graphs (cuda_graphs.py) and, where the next step is determined on the device, the next step is
launched before this one is read back (lookahead.py); on the CPU they run a compiled graph
(compiled_decode.py). The only host<->device synchronisation per
step is reading back the sampled ids and the logprobs that were asked for, once, together.

With tensor parallelism (tensor_parallel.py) rank 0's runner sends each step to the other ranks
before running it (`tp_driver`), and their runners run the same forward without sampling
(`follow`).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from paphos.core.protocol import LoRARequest, TokenLogprobs
from paphos.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from paphos.lora.slots import AdapterSlots
from paphos.sample.guided import GuidedState
from paphos.sample.metadata import SamplingMetadata
from paphos.sample.sampler import Sampler, SamplerOutput
from paphos.worker.compiled_decode import CompiledDecode
from paphos.worker.cuda_graphs import DecodeGraphs
from paphos.worker.input_batch import (
    DeviceUploader,
    RequestState,
    StepInputs,
    apply_scheduler_diffs,
    build_step_inputs,
)
from paphos.worker.kv_cache import KVCacheSpec, allocate_kv_caches
from paphos.worker.lookahead import (
    Lookahead,
    Readback,
    next_slots_if_allocated,
    next_step_metadata,
)

if TYPE_CHECKING:
    from paphos.worker.tensor_parallel import TPDriver


def derive_seed(seed: int) -> int:
    """Spreads user seeds over the generator's state space (seeds 1 and 2 share no prefix)."""
    digest = hashlib.sha256(seed.to_bytes(16, "little", signed=True)).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_spec: KVCacheSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        vocab_size: int,
        eos_token_id: int | None,
        max_model_len: int,
        decode_lookahead: bool,
        extra_eos_token_ids: tuple[int, ...],
        grammar_info: Callable[[], xgr.TokenizerInfo],
    ) -> None:
        """grammar_info builds the tokenizer info guided requests' grammars load against (once,
        at the first guided request)."""
        self.model = model
        self.max_model_len = max_model_len
        self.decode_lookahead = decode_lookahead
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.extra_eos_token_ids = extra_eos_token_ids
        self.kv_caches = allocate_kv_caches(kv_spec, num_blocks, block_size, device)
        self.uploader = DeviceUploader(device)
        # Set up by `capture_decode_graphs` (GPU, not --enforce-eager); None = every step eager.
        self.decode_graphs: DecodeGraphs | None = None
        # With LoRA, a second set recording the adapters' kernels, replayed when a row uses an
        # adapter: steps of base-model rows only pay nothing for LoRA being enabled.
        self.lora_decode_graphs: DecodeGraphs | None = None
        # The set the last replay used (the lookahead replays its next step on the same one).
        self._replayed: DecodeGraphs | None = None
        # Set up by `compile_decode` (CPU, not --enforce-eager).
        self.compiled_decode: CompiledDecode | None = None
        # Device slots of LoRA adapters (attached by worker/setup.py when LoRA is enabled).
        self.adapter_slots: AdapterSlots | None = None
        # Rank 0 of a tensor-parallel group: sends each step to the other ranks (set by setup.py).
        self.tp_driver: TPDriver | None = None
        # The next decode step, launched before this one was read back (lookahead.py), or None.
        self._lookahead: Lookahead | None = None
        self.sampler = Sampler()
        self.states: dict[str, RequestState] = {}
        # Per-sequence sampling state outlives preemption (a resumed request continues its random
        # stream, mirostat mu and grammar), so it is keyed by request id apart from the input state
        # and dropped only on finish.
        self.seeds: dict[str, int] = {}
        self.mirostat_mu: dict[str, torch.Tensor] = {}
        self.guided = GuidedState(grammar_info)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.tp_driver is not None:
            return self.tp_driver.run_step(scheduler_output, self._execute)
        return self._execute(scheduler_output)

    @torch.inference_mode()
    def follow(
        self, scheduler_output: SchedulerOutput, sampled: list[tuple[str, int]], adapters: Sequence[LoRARequest] = ()
    ) -> None:
        """A tensor-parallel follower's step: rank 0's `execute` of the same step without sampling.
        `sampled`: the tokens rank 0 appended after its previous step; `adapters`: LoRA adapters
        rank 0 started loading (this rank loads its slices of them). Every collective rank 0's
        forward reaches (the layers' all-reduces, the head's gather, prompt-logprob rows) is
        reached here in the same order, from the same flat batch."""
        if self.adapter_slots is not None:
            for lora in adapters:
                self.adapter_slots.host.announce(lora)
        for req_id, token in sampled:
            state = self.states.get(req_id)
            if state is not None:
                state.token_ids.append(token)
        apply_scheduler_diffs(self.states, scheduler_output)
        if scheduler_output.is_empty:
            return
        inputs = build_step_inputs(self.states, scheduler_output, self.block_size, self.uploader)
        self._prepare_adapters(inputs.req_ids, scheduler_output)
        hidden, _ = self._forward(inputs)
        for rows, _targets in inputs.prompt_logprob_rows.values():
            assert hidden is not None
            self.model.compute_logits(hidden[rows])

    def _prepare_adapters(self, req_ids: list[str], scheduler_output: SchedulerOutput) -> None:
        """The step's adapter per token row, each adapter in a device slot (lora/slots.py)."""
        if self.adapter_slots is not None:
            self.adapter_slots.prepare(
                [self.states[r].lora_id for r in req_ids], list(scheduler_output.num_scheduled_tokens.values())
            )

    @torch.inference_mode()
    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in scheduler_output.finished_req_ids:
            self._forget_sampling_state(req_id)
        apply_scheduler_diffs(self.states, scheduler_output)
        lookahead, self._lookahead = self._lookahead, None
        if scheduler_output.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], sampled_logprobs=[])

        inputs = build_step_inputs(self.states, scheduler_output, self.block_size, self.uploader)
        self._prepare_adapters(inputs.req_ids, scheduler_output)
        num_reqs = len(inputs.req_ids)
        output = ModelRunnerOutput(inputs.req_ids, [[] for _ in range(num_reqs)], [[] for _ in range(num_reqs)])
        states = [self.states[inputs.req_ids[i]] for i in inputs.sampling_reqs]

        hidden: torch.Tensor | None = None
        result: SamplerOutput | None = None
        if lookahead is not None and lookahead.matches(inputs.req_ids, inputs.host_positions, inputs.host_slots):
            result, metadata, on_graphs = lookahead.result, lookahead.metadata, True
        else:
            hidden, sampling_logits = self._forward(inputs)
            # The lookahead replays CUDA graphs only (a compiled CPU step runs synchronously).
            on_graphs = hidden is None and self.decode_graphs is not None
            if inputs.sampling_reqs:
                assert sampling_logits is not None
                metadata = self._sampling_metadata(states)
                result = self._sample(sampling_logits[:, : self.vocab_size], states, metadata)
        if result is not None:
            readback = Readback.start(result)
            if on_graphs and self.decode_lookahead:
                self._lookahead = self._launch_lookahead(inputs, states, result, metadata)
            self._accept(readback.wait(), states, inputs.sampling_reqs, output)
            output.failed = self.guided.take_failures()

        for batch_idx, (rows, targets) in inputs.prompt_logprob_rows.items():
            assert hidden is not None  # steps with prompt logprobs never run on the graphs
            state = self.states[inputs.req_ids[batch_idx]]
            output.prompt_logprobs[state.req_id] = self._prompt_logprobs(
                hidden[rows], targets, state.sampling_params.prompt_logprobs or 0
            )
        return output

    def unload_adapter(self, lora_id: int) -> None:
        if self.adapter_slots is not None:
            self.adapter_slots.unload(lora_id)

    def compile_decode(self, max_num_seqs: int) -> None:
        self.compiled_decode = CompiledDecode(self.model, self.kv_caches, max_num_seqs)
        self.compiled_decode.warm_up()

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        def graphs() -> DecodeGraphs:
            return DecodeGraphs(self.model, self.kv_caches, max_num_seqs, max_model_len, self.block_size, self.device)

        self.decode_graphs = graphs()
        self.decode_graphs.capture()  # no step mapping set: the adapters' kernels are not recorded
        if self.adapter_slots is not None:
            self.lora_decode_graphs = graphs()
            self.adapter_slots.batch.record_graphs(self.lora_decode_graphs.buckets)
            self.lora_decode_graphs.capture()

    def _forward(self, inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's forward pass -> (hidden states of every row, or None when a graph ran;
        fp32 logits of the sampling rows, or None when no row samples)."""
        md = inputs.attn_metadata
        every_row_samples = len(inputs.sampling_rows) == md.num_tokens and not inputs.prompt_logprob_rows
        lora = self.adapter_slots.batch if self.adapter_slots is not None else None
        graphs = self.lora_decode_graphs if lora is not None and lora.active else self.decode_graphs
        if graphs is not None and every_row_samples and graphs.can_run(md):
            if graphs is self.lora_decode_graphs:
                assert lora is not None
                # The graph reads its batch size's mapping buffers: write this step's into them.
                lora.mapping_for(graphs.bucket(md.num_tokens))
            self._replayed = graphs
            return None, graphs.run(inputs.input_ids, inputs.positions, md)
        if self.compiled_decode is not None and every_row_samples and self.compiled_decode.can_run(md):
            return None, self.compiled_decode.run(inputs.input_ids, inputs.positions, md)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, md)
        head = self.compiled_decode.logits if self.compiled_decode is not None else self.model.compute_logits
        logits = head(hidden[inputs.sampling_rows]) if inputs.sampling_reqs else None
        return hidden, logits

    def _seed(self, state: RequestState) -> int:
        """The request's RNG seed (rng.py): derived from `seed`, else drawn once at first sight.
        Kept by request id apart from the input state, so it outlives preemption."""
        seed = self.seeds.get(state.req_id)
        if seed is None:
            user_seed = state.sampling_params.seed
            seed = derive_seed(user_seed) if user_seed is not None else secrets.randbits(63)
            self.seeds[state.req_id] = seed
        return seed

    def _launch_lookahead(
        self, inputs: StepInputs, states: list[RequestState], result: SamplerOutput, metadata: SamplingMetadata
    ) -> Lookahead | None:
        """Replays the next decode step of this graph batch now, if it is fully determined on the
        device (lookahead.py); None otherwise."""
        assert self._replayed is not None
        eligible = all(
            s.stateless
            and s.sampling_params.min_tokens <= s.num_output_tokens
            and (s.sampling_params.max_tokens is None or s.num_output_tokens + 1 < s.sampling_params.max_tokens)
            for s in states
        )
        next_slots = next_slots_if_allocated(inputs.host_positions, [s.block_ids for s in states],
                                             self.block_size, self.max_model_len) if eligible else None
        if next_slots is None:
            return None
        logits = self._replayed.run_next(result.sampled_token_ids, inputs.attn_metadata.block_tables)
        # The rows' params exclude everything that reads the history (no min_tokens mask left
        # either), so the next step's metadata is this one's with the positions moved on, on the
        # device: no host data is built or copied (a pageable host->device copy would wait for the
        # replay just queued).
        next_metadata = next_step_metadata(metadata)
        next_result = self._sample(logits[:, : self.vocab_size], states, next_metadata)
        return Lookahead(list(inputs.req_ids), inputs.host_positions + 1, next_slots, next_result, next_metadata)

    def _sampling_metadata(self, states: list[RequestState]) -> SamplingMetadata:
        rows = [(row, s.req_id, s.sampling_inputs.grammar, s.num_output_tokens) for row, s in enumerate(states)]
        return SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            seeds=[self._seed(s) for s in states],
            token_ids=[s.token_ids for s in states],
            num_prompt_tokens=[s.num_prompt_tokens for s in states],
            eos_token_id=self.eos_token_id,
            vocab_size=self.vocab_size,
            device=self.device,
            mirostat_mu=[self.mirostat_mu.get(s.req_id) for s in states],
            position_bans=[s.position_bans.get(s.num_output_tokens, ()) for s in states],
            grammar_bitmask=self.guided.bitmask(rows, self.vocab_size),
            sampler_rows=[s.sampler_row for s in states],
            sampling_inputs=[s.sampling_inputs for s in states],
            extra_eos_token_ids=self.extra_eos_token_ids,
        )

    def _sample(self, logits: torch.Tensor, states: list[RequestState], metadata: SamplingMetadata) -> SamplerOutput:
        """Sampler call for the rows that sample this step; the result stays on the device."""
        result = self.sampler(logits, metadata)
        if result.mirostat_mu is not None:
            for row, state in enumerate(states):
                if state.sampling_params.mirostat_mode:
                    self.mirostat_mu[state.req_id] = result.mirostat_mu[row]
        return result

    def _accept(
        self, result: Readback, states: list[RequestState], batch_indices: list[int], output: ModelRunnerOutput
    ) -> None:
        """Appends the sampled tokens to the request states and fills `output`."""
        tokens = result.sampled.tolist()
        lps = result.logprobs.tolist()
        ranks = result.ranks.tolist() if result.ranks is not None else None
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        if self.tp_driver is not None:
            self.tp_driver.note_sampled([s.req_id for s in states], tokens)
        for row, (batch_idx, state) in enumerate(zip(batch_indices, states, strict=True)):
            token = tokens[row]
            state.token_ids.append(token)
            if state.sampling_inputs.grammar is not None:
                self.guided.accept(state.req_id, token)
            output.sampled_token_ids[batch_idx] = [token]
            output.sampled_logprobs[batch_idx] = [lps[row]]
            k = state.sampling_params.logprobs
            if k is not None:
                output.logprobs[state.req_id] = [
                    TokenLogprobs(
                        token_id=token,
                        logprob=lps[row],
                        rank=ranks[row] if ranks is not None else 0,
                        top_token_ids=top_ids[row][:k] if top_ids else [],
                        top_logprobs=top_lps[row][:k] if top_lps else [],
                    )
                ]

    def _forget_sampling_state(self, req_id: str) -> None:
        self.seeds.pop(req_id, None)
        self.mirostat_mu.pop(req_id, None)
        self.guided.drop(req_id)

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
        logprobs = self.model.compute_logits(hidden)[:, : self.vocab_size].float().log_softmax(dim=-1)
        target_ids = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
        target_lps = logprobs.gather(1, target_ids)
        ranks = ((logprobs > target_lps).sum(dim=-1) + 1).tolist()
        target_lps = target_lps.squeeze(1).tolist()
        top_lps, top_ids = logprobs.topk(max(k, 1), dim=-1)
        top_ids_l = top_ids[:, :k].tolist()
        top_lps_l = top_lps[:, :k].tolist()
        return [
            TokenLogprobs(targets[j], target_lps[j], ranks[j], top_ids_l[j], top_lps_l[j])
            for j in range(len(targets))
        ]
