"""The kernel choices a user names, in a module free of torch: the CLI's options and the runtime's
checks (minidecode/validate.py) import them from here without loading a kernel."""

PREFILL_ATTENTION = ("auto", "fp8")  # auto: SDPA's measured backend; fp8: the FP8 flash-attention kernel
