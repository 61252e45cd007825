"""Per-layer forms: each layer family's per-example statistics.

A *unit* is one layer call's share of the per-example gradients. It answers
the questions of `tfdpx.gradients.PerExampleGradients` (squared norms, dots
with directions, masked squared norms, a weighted sum, and, as the escape
hatch, the materialized gradients) from what the batched forward and backward
passes recorded, with the cheapest exact form its layer family has
(`shared/notes/per-example-statistics.md`):

- `dense`: a product `A_i^T D_i` per example (Dense on vectors or sequences,
  convolutions over their patches): ghost forms or chunked materialization,
  chosen from static shapes;
- `embedding`: only the rows of the tokens present (segment sums);
- `materialized`: small parameters and layers without a cheaper form, in
  chunks of examples reduced at once.

These modules know nothing of Keras: `tfdpx.keras.layer_rules` builds units
from Keras layers.
"""
