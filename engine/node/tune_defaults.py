"""The tuner's default workload, shared by `strata-node tune`'s command line and the tuner."""

DEFAULT_MIX = ((8192, 0.3), (32768, 0.5), (102400, 0.2))  # the seed's 30% 8K / 50% 32K / 20% 100K
DEFAULT_ANSWER = 320
