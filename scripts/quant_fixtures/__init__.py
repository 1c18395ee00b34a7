"""Producers of the quantized-checkpoint test fixtures in `tests/quant/data/checkpoints/`.

`scripts/make_quant_fixtures.py` drives them: `common` (the tiny model, the prompts, the reference
file) runs in every venv; each other module runs in its own tool's venv and knows only how to call
that tool: `gptqmodel_fixtures` (GPTQ, AWQ via GPTQModel), `llmc_fixtures` (llm-compressor /
compressed-tensors), `autoawq_fixtures` (AutoAWQ GEMM).
"""
