"""Fast paths of the sampler (issue 5): fewer full-vocabulary passes, no full-vocabulary sort.

Design (each module says more):
- rowstats.py: the row max, the first argmax and the logsumexp of the raw logits (the logprob
  normaliser; greedy costs about one `argmax`).
- race.py: the draw. A row samples argmax_i(l_i + G_i), G_i = -log(-log u_i), with u_i a
  counter-based uniform of (seed, position, token id) (exponential race / Gumbel-max). It has
  exactly the softmax distribution of the surviving logits, needs no normaliser, no cumsum and no
  sort, is a pure function of (seed, position) per row and does not care whether the candidates
  are the whole vocabulary or a compacted, id-ordered subset. One algorithm on CPU and GPU: the
  Triton kernels (dense rows on CUDA) and the torch code compute the same hashes and formula.
- compact.py: candidate compaction at top-k. After top-k (k known on the host for every row of a
  group) at most C = k + max(k, 256) tokens survive unless more than C - k tokens tie at the k-th
  value; the chain continues on dense [R, C] values + token ids sorted by id, so every later
  set-function stage (and skew and the draw) runs on C columns with the unchanged ops.
- dense_tail.py: groups whose chain is only (static temperature, top-p, min-p) run fused kernels on
  CUDA: per-tile max / normaliser and a 1-nat mass histogram, the exact top-p boundary from the
  histogram's bracket (gathered and sorted, sort-free over the vocabulary), min-p and the race,
  without writing the masked logits. The torch formulation is the chain's ops + race.py.
- chain.py: on CUDA, batches whose rows run history stages, then at most temperature / top-nσ,
  then top-k, then set stages (SamplingMetadata.fused) take the top-C raw logits and one program
  per row applies the row's own stage codes in registers (full-vocabulary statistics for the stages
  before top-k from one tiled read), skew and the race: one kernel instead of ~300 small torch ops.
- kernels.py: the Triton kernels, each row split over ~128 tiles (grid rows x tiles) with per-row
  combines; `use_kernels(x)` decides (CUDA tensors, or forced in tests under the interpreter with
  `force_kernels`).
"""
