"""Fast paths of the sampler (issue 5): fewer full-vocabulary passes, no full-vocabulary sort.

Design (each module says more):
- rowstats.py: one read of the raw logits gives the row max, the first argmax and the logsumexp
  (online); greedy costs about one `argmax` and the logprob normaliser comes with it.
- race.py: the draw. A row samples argmax_i(l_i + G_i), G_i = -log(-log u_i), with u_i a
  counter-based uniform of (seed, position, token id) (exponential race / Gumbel-max). It has
  exactly the softmax distribution of the surviving logits, needs no normaliser, no cumsum and no
  sort, is a pure function of (seed, position) per row and does not care whether the candidates
  are the whole vocabulary or a compacted, id-ordered subset. One algorithm on CPU and GPU: the
  Triton kernel (dense rows on CUDA) and the torch code compute the same hashes and formula.
- compact.py: candidate compaction at top-k. After top-k (k known on the host for every row of a
  group) at most C = k + max(k, 256) tokens survive unless more than C - k tokens tie at the k-th
  value; the chain continues on dense [R, C] values + token ids sorted by id, so every later
  set-function stage (and skew and the draw) runs on C columns with the unchanged ops.
- dense_tail.py: groups whose chain is only (static temperature, top-p, min-p) run one fused
  kernel on CUDA: scaled max / normaliser, an exact sort-free top-p threshold (multi-pivot
  search over monotone float keys, then the boundary bucket sorted in registers), min-p and the
  race, without writing the masked logits. The torch formulation is the chain's ops + race.py.
- kernels.py: the Triton kernels; `use_kernels(x)` decides (CUDA tensors, or forced in tests
  under the interpreter with `force_kernels`).
"""
