"""Fakes for logic tests around the real parts (never instead of their own tests)."""

from hybrid_rl.rollout.base import GenerateStats


class NullEngine:
    """The rollout side of a HybridSwitch that takes weights and generates nothing; ``fail`` makes
    every load raise (a sync that breaks halfway)."""

    supports_sleep = False
    last_stats = GenerateStats()

    def __init__(self, fail: bool = False) -> None:
        self.loads, self.fail = 0, fail

    def load_weights(self, weights) -> None:
        for _ in weights:
            pass
        if self.fail:
            raise RuntimeError("load failed")
        self.loads += 1

    def reset_prefix_cache(self) -> None:
        pass

    def sleep(self, level: int = 1) -> bool:
        return False

    def memory_report(self) -> dict:
        return {}
