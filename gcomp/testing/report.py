"""What ``check_method`` hands back: the contracts, a ``Result`` per (contract, configuration), the ``Report``,
``ContractError`` listing every failure; and ``Skip``, raised by a check that does not apply (with the reason)."""
from __future__ import annotations

from dataclasses import dataclass, field

# number -> (key, what the contract asserts)
CONTRACTS = {
    1: ("reduce", "shape, dtype and device kept; every rank gets the same result, the mean of what they sent"),
    2: ("replicas", "replicas identical after DDP training; the statistics right"),
    3: ("homomorphism", "all-reduce codecs: decoding the sum of payloads is the sum of decoded payloads"),
    4: ("lossless", "lossless methods equal the dense mean and plain DDP"),
    5: ("conservation", "error feedback: what was sent plus what is held back is the gradient plus what was held"),
    6: ("nonfinite", "a NaN or infinity on one rank surfaces on every rank"),
    7: ("state_dict", "a checkpoint resumed on a fresh model and hook is bit-identical to a run never stopped"),
    8: ("configuration", "bad configuration fails early and clearly"),
    9: ("fidelity", "the result keeps the error model the compressor declares (traits.fidelity)"),
    10: ("bytes", "bytes_sent of a bucket is traits.wire_bytes(bucket, world)"),
    11: ("fsdp", "FSDP2's reduce-scatter: this rank's shard of the sum as the error model says, error feedback "
                 "conserved, a non-finite entry on its shard, AVG divided by the shard count"),
}
NUMBERS = {key: number for number, (key, _) in CONTRACTS.items()}
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
DETAIL_CHARS = 2000  # of one failure, in ContractError's message (the report keeps it whole)


class Skip(Exception):
    """Raised by a check that does not apply to the method; its message is the reason."""


@dataclass(frozen=True)
class Result:
    """One (contract, configuration): passed, failed or skipped; ``detail`` the message, reason or note."""

    contract: str
    config: str
    status: str
    detail: str = ""

    @property
    def number(self) -> int:
        return NUMBERS[self.contract]

    def line(self, limit: int | None = None) -> str:
        detail = self.detail if limit is None or len(self.detail) <= limit else self.detail[:limit] + " [...]"
        text = f"{self.status.upper():7} {self.number} {self.contract} [{self.config}]"
        return f"{text}: {detail}" if detail else text


@dataclass
class Report:
    """Every (contract, configuration) ``check_method`` checked for ``method``, in the order checked."""

    method: str
    results: list[Result] = field(default_factory=list)

    def add(self, contract: str, config: str, status: str, detail: str = "") -> Result:
        result = Result(contract, config, status, detail)
        self.results.append(result)
        return result

    passed = property(lambda self: [r for r in self.results if r.status == PASSED])
    failures = property(lambda self: [r for r in self.results if r.status == FAILED])
    skipped = property(lambda self: [r for r in self.results if r.status == SKIPPED])
    ok = property(lambda self: not self.failures, doc="No failure (skips are not failures).")

    def failed_contracts(self) -> list[str]:
        """The keys of the contracts with a failure, in contract order."""
        return sorted({r.contract for r in self.failures}, key=NUMBERS.__getitem__)

    def summary(self) -> str:
        return (f"{self.method}: {len(self.passed)} passed, {len(self.failures)} failed, {len(self.skipped)} "
                f"skipped" + (f" (failed: {', '.join(self.failed_contracts())})" if self.failures else ""))

    def __str__(self) -> str:
        return "\n".join([self.summary(), *(r.line() for r in self.results)])


class ContractError(AssertionError):
    """A method broke at least one contract; the message lists every failure, ``report`` holds them all."""

    def __init__(self, report: Report):
        self.report = report
        failures = report.failures
        lines = [f"{report.method} broke {len(failures)} check(s) of contract(s) "
                 f"{', '.join(f'{NUMBERS[c]} {c}' for c in report.failed_contracts())}:"]
        lines += [r.line(DETAIL_CHARS) for r in failures]
        super().__init__("\n".join(lines))
