"""The lightning indexer: which compressed positions each query attends to.

Scoring every compressed position with full attention would cost as much as dense attention,
so V4.1 first scores them cheaply: a few small fp4-quantised index heads, ReLU'd dot products
against fp4 index keys, mixed by per-token head weights. Each query keeps the ``index_topk``
best positions, chosen exactly as torch's CPU ``topk`` chooses them (ties included). The
*candidate source* also publishes, per query, the best blocks of positions; later index sources
(candidate consumers) may only pick inside those blocks.

The scores are computed a tile of queries at a time, so a prefill never holds a
``[seqlen, positions]`` tensor unless the caller asks to capture it. Their dot products are of
fp4 values, exact in f32 whatever the summation order (unless a row's block scales lie ~2^10
apart), so they run wherever they run fastest: as integer dot products on AMX or AVX512-VNNI,
or on AVX512-BF16, against a packed copy of the keys (:class:`IndexKeyCache`), else through
numpy's f32 BLAS; all give the same scores.

One module a concept:

- ``lightning``: the indexer itself (config, weights, index keys, the per-step driver:
  project, rotate, quantise, score, mask, select);
- ``visibility``: which positions a query sees, and score rows masked to them;
- ``blas_scores``: the scores through numpy's BLAS and torch's head mix;
- ``query_layouts``: a tile's queries as each packed kernel's operand;
- ``packed_scores``: one parallel kernel a packed layout, chosen by the layout's name;
- ``tier_scores``: each tier's entry point, and which tier scores a head size;
- ``key_cache``: :class:`IndexKeyCache`, the keys in the layout their tier reads;
- ``block_maxima``: the rows' maxima over blocks of positions;
- ``candidates``: the candidate source's blocks;
- ``candidate_scores``: a candidate consumer's scores, formed only inside its candidate blocks;
- ``selection``: the top-k selection.
"""

from .candidates import candidate_mask, select_candidate_blocks
from .key_cache import IndexKeyCache
from .lightning import IndexerCfg, IndexerWeights, index_keys, indexer
from .visibility import visible_lengths

__all__ = ["IndexerWeights", "IndexerCfg", "IndexKeyCache", "indexer", "index_keys",
           "select_candidate_blocks", "candidate_mask", "visible_lengths"]
