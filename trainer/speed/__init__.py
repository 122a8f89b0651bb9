"""Exact, faster ways to compute what the chapter's code computes: the same log-probs with less memory
(``selective_log_softmax``) or with each prompt's forward shared by its G answers (``shared_prefix``)."""
