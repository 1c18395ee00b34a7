"""ModelRunner: SchedulerOutput -> one forward pass over the flat batch -> ModelRunnerOutput.

Owns the model, the paged KV cache tensors, the per-request input state and the per-request
random generators. The only host<->device synchronisation per step is reading back the sampled
ids and the logprobs that were asked for.
"""

from __future__ import annotations

import hashlib

import torch

from paphos.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from paphos.sample.metadata import SamplingMetadata
from paphos.sample.sampler import Sampler
from paphos.worker.input_batch import RequestState, apply_scheduler_diffs, build_step_inputs
from paphos.worker.kv_cache import KVCacheSpec, allocate_kv_caches


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
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.kv_caches = allocate_kv_caches(kv_spec, num_blocks, block_size, device)
        self.sampler = Sampler()
        self.states: dict[str, RequestState] = {}
        # Generators outlive preemption (a resumed request continues its random stream), so
        # they are keyed by request id apart from the input state and dropped only on finish.
        self.generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in scheduler_output.finished_req_ids:
            self.generators.pop(req_id, None)
        apply_scheduler_diffs(self.states, scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], sampled_logprobs=[])

        inputs = build_step_inputs(self.states, scheduler_output, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)

        num_reqs = len(inputs.req_ids)
        sampled_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        sampled_lps: list[list[float]] = [[] for _ in range(num_reqs)]
        output = ModelRunnerOutput(inputs.req_ids, sampled_ids, sampled_lps)

        if inputs.sampling_reqs:
            states = [self.states[inputs.req_ids[i]] for i in inputs.sampling_reqs]
            logits = self.model.compute_logits(hidden[inputs.sampling_rows])
            metadata = SamplingMetadata.build(
                params=[s.sampling_params for s in states],
                generators=[self._generator(s) for s in states],
                num_output_tokens=[s.num_output_tokens for s in states],
                eos_token_id=self.eos_token_id,
                vocab_size=self.vocab_size,
                device=self.device,
            )
            result = self.sampler(logits[:, : self.vocab_size], metadata)
            tokens = result.sampled_token_ids.tolist()
            lps = result.sampled_logprobs.tolist()
            ranks = result.sampled_ranks.tolist()
            top_ids = result.top_token_ids.tolist() if result.top_token_ids is not None else None
            top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
            for row, (batch_idx, state) in enumerate(zip(inputs.sampling_reqs, states, strict=True)):
                token = tokens[row]
                state.token_ids.append(token)
                sampled_ids[batch_idx] = [token]
                sampled_lps[batch_idx] = [lps[row]]
                k = state.sampling_params.logprobs
                if k is not None:
                    output.logprobs[state.req_id] = [
                        TokenLogprobs(
                            token_id=token,
                            logprob=lps[row],
                            rank=ranks[row],
                            top_token_ids=top_ids[row][:k] if top_ids else [],
                            top_logprobs=top_lps[row][:k] if top_lps else [],
                        )
                    ]

        for batch_idx, (rows, targets) in inputs.prompt_logprob_rows.items():
            state = self.states[inputs.req_ids[batch_idx]]
            output.prompt_logprobs[state.req_id] = self._prompt_logprobs(
                hidden[rows], targets, state.sampling_params.prompt_logprobs or 0
            )
        return output

    def _generator(self, state: RequestState) -> torch.Generator | None:
        seed = state.sampling_params.seed
        if seed is None:
            return None
        generator = self.generators.get(state.req_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(derive_seed(seed))
            self.generators[state.req_id] = generator
        return generator

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
