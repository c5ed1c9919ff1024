"""Per-row statistics the fused head kernel can compute in its one pass over the vocab.

Each is a scalar per active row (after the tensor-parallel exchange). A term declares the
subset it needs; the compiler unions them into the HeadPlan.
"""

from enum import StrEnum


class Stat(StrEnum):
    LSE = "lse"  # logsumexp_v z_v (online max + sum of exp)
    TARGET_LOGIT = "target_logit"  # z_y, the logit of the row's target
    EXPECTED_LOGIT = "expected_logit"  # sum_v p_v z_v; entropy H = lse - expected_logit
    ARGMAX = "argmax"  # argmax_v z_v (acceptance proxy for MTP heads)
    TEACHER_LSE = "teacher_lse"  # logsumexp of the teacher row (policy row t+k, or distill)
    TEACHER_CROSS = "teacher_cross"  # sum_v q_v z_v, q the teacher distribution
    TEACHER_TOPK = "teacher_topk"  # the teacher's top-k token ids and logits
