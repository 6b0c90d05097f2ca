"""The one logit that masks a key out: every attention implementation and attention pooling use it."""

# The logit given to a key that may not be attended. Finite, so that a row with no valid key (an all-padding
# filler row) gets a uniform softmax instead of NaN; exp of it underflows to exactly 0 next to any real logit; and
# adding a logit to it never overflows float32 to -inf.
MASK_VALUE = -1e30
