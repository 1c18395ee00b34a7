"""Decode lookahead (paphos/worker/lookahead.py) on CPU: the runner's matching, launching and
dropping logic, with an eager stand-in for the CUDA graphs that keeps the same static-buffer
semantics (`run` copies a decode batch in, `run_next` advances it by one token on the device).

The engine must produce the same tokens with and without the lookahead, whether the looked-ahead
step is taken (plain greedy decoding) or dropped (a request finishing, a new request arriving,
a stop string, a row at a block boundary, a sampled row).
"""

from __future__ import annotations

import torch

from paphos import LLM, SamplingParams
from paphos.attention.metadata import AttentionMetadata
from paphos.worker import model_runner as model_runner_module


class EagerDecodeGraphs:
    """The DecodeGraphs interface, run eagerly: what the graphs compute, without CUDA."""

    def __init__(self, runner: model_runner_module.ModelRunner) -> None:
        self.runner = runner
        self.state: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.replays = 0
        self.advances = 0

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return metadata.max_query_len == 1

    def _forward(self) -> torch.Tensor:
        assert self.state is not None
        ids, positions, slots, seq_lens, tables = self.state
        n = ids.shape[0]
        md = AttentionMetadata(
            num_tokens=n, query_start_loc=torch.arange(n + 1, dtype=torch.int32), seq_lens=seq_lens,
            block_tables=tables, slot_mapping=slots, max_query_len=1, max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=seq_lens.tolist(),
        )
        model = self.runner.model
        return model.compute_logits(model(ids, positions, self.runner.kv_caches, md))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        self.replays += 1
        self.state = (input_ids.clone(), positions.clone(), metadata.slot_mapping.clone(),
                      metadata.seq_lens.clone(), metadata.block_tables.clone())
        return self._forward()

    def run_next(self, sampled_ids: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        assert self.state is not None
        self.advances += 1
        _ids, positions, _slots, seq_lens, _tables = self.state
        positions = positions + 1
        block_size = self.runner.block_size
        blocks = block_tables.long().gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
        self.state = (sampled_ids.clone(), positions, blocks * block_size + positions % block_size,
                      seq_lens + 1, block_tables.clone())
        return self._forward()


def _llm(tiny_model) -> LLM:
    path, _ = tiny_model()
    return LLM(str(path), dtype="float32", max_num_batched_tokens=32, max_num_seqs=8, block_size=8,
               decode_lookahead=True)


def _generate(llm: LLM, graphs: EagerDecodeGraphs | None, prompts, params) -> list[list[int]]:
    llm.engine.runner.decode_graphs = graphs
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_lookahead_gives_the_same_tokens_and_is_taken_for_plain_greedy_decoding(tiny_model) -> None:
    llm = _llm(tiny_model)
    prompts = ["w5 w6 w7", "w9 w10 w11 w12 w13 w14 w15 w16 w17 w18", "w20"]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = _generate(llm, None, prompts, params)
    graphs = EagerDecodeGraphs(llm.engine.runner)
    assert _generate(llm, graphs, prompts, params) == want
    # Nearly every decode step came from the lookahead: the scheduler hands out each next block
    # a step early, so only the first decode step and those after a request finished replay from
    # the host.
    assert graphs.advances > 4 * graphs.replays


def test_dropped_lookaheads_leave_outputs_unchanged(tiny_model) -> None:
    llm = _llm(tiny_model)
    prompts = ["w5 w6 w7", "w9 w10 w11", "w30 w31", "w40"]
    # Different lengths finish requests mid-batch; a stop string ends one early; a row with a
    # repetition penalty (it reads the history) never looks ahead; a lone token prompt decodes
    # beside longer ones.
    params = [
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=17, stop=["w3"]),
    ]
    want = _generate(llm, None, prompts, params)
    graphs = EagerDecodeGraphs(llm.engine.runner)
    assert _generate(llm, graphs, prompts, params) == want


def test_seeded_sampled_rows_look_ahead_with_the_same_draws(tiny_model) -> None:
    """Stateless samplers (temperature, top-k/p, min-p, XTC...) key their draws by (seed, output
    position): the looked-ahead step draws with the next position and gives the same tokens."""
    llm = _llm(tiny_model)
    prompts = ["w5 w6 w7", "w9 w10 w11 w12", "w20"]
    params = [
        SamplingParams(temperature=0.9, seed=11, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=20, top_p=0.9, min_p=0.02, seed=5, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.05, seed=3, max_tokens=25,
                       ignore_eos=True),
    ]
    want = _generate(llm, None, prompts, params)
    assert len({tuple(t) for t in want}) == 3
    graphs = EagerDecodeGraphs(llm.engine.runner)
    assert _generate(llm, graphs, prompts, params) == want
    assert graphs.advances > 4 * graphs.replays


def test_requests_arriving_during_decoding_drop_the_lookahead(tiny_model) -> None:
    llm = _llm(tiny_model)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(graphs: EagerDecodeGraphs | None) -> dict[str, list[int]]:
        engine.runner.decode_graphs = graphs
        tokens: dict[str, list[int]] = {}
        engine.add_request("first", llm.tokenizer.encode("w5 w6 w7"), params)
        steps = 0
        while engine.has_unfinished_requests():
            steps += 1
            if steps == 4:
                engine.add_request("second", llm.tokenizer.encode("w8 w9"), params)
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        return tokens

    want = run(None)
    assert run(EagerDecodeGraphs(engine.runner)) == want


def test_lookahead_is_off_unless_asked_for(tiny_model) -> None:
    path, _ = tiny_model()
    llm = LLM(str(path), dtype="float32", block_size=8)
    graphs = EagerDecodeGraphs(llm.engine.runner)
    _generate(llm, graphs, ["w5 w6 w7"], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert graphs.advances == 0 and graphs.replays == 9
