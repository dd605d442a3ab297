"""What an operator scrapes from `GET /metrics`: Prometheus counters, gauges and latency
histograms of the requests served, the tokens generated and the target forwards that
produced them (their ratio is the mean acceptance length tau that decides the speed-up).

Updated from the engine thread and read from the event loop, under one lock.
"""
from __future__ import annotations

import threading

OUTCOMES = ("ok", "error", "cancelled")
FINISH_REASONS = ("stop", "length", "abort")
# Upper bounds (seconds) of the latency histograms: a speculative request of a few hundred
# tokens takes tens of milliseconds on a small model, seconds on a large one.
FIRST_TOKEN_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REQUEST_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    """A Prometheus histogram: how many observations fell at or below each bound, their
    sum and their count (the +Inf bucket)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts = bounds, [0] * len(bounds)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1

    def samples(self) -> list[tuple[str, float]]:
        """(suffix with labels, value) in exposition order; buckets are cumulative."""
        return ([(f'_bucket{{le="{float(b)}"}}', c) for b, c in zip(self.bounds, self.counts)]
                + [('_bucket{le="+Inf"}', self.count), ("_sum", self.sum), ("_count", self.count)])


class ServerMetrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.request_seconds = Histogram(REQUEST_BOUNDS)
        self.first_token_seconds = Histogram(FIRST_TOKEN_BOUNDS)
        self.choices = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_tokens = self.generated_tokens = self.generation_rounds = 0

    def choice_done(self, prompt_tokens: int, output) -> None:
        """One generation finished (a `GenerationOutput`); `prompt_tokens` counts its
        prompt's tokens once per request (0 for the prompt's further choices)."""
        with self.lock:
            self.choices[output.finish_reason] = self.choices.get(output.finish_reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += len(output.token_ids)
            self.generation_rounds += output.stats.get("rounds", 0)

    def first_token(self, seconds: float) -> None:
        """A request got its first token `seconds` after it arrived (queueing and prefill)."""
        with self.lock:
            self.first_token_seconds.observe(seconds)

    def request_done(self, outcome: str, seconds: float) -> None:
        """A request that reached the engine's queue was answered: "ok", "error", or
        "cancelled" (its client went away); `seconds` from its arrival, queueing included."""
        with self.lock:
            self.requests[outcome] += 1
            self.request_seconds.observe(seconds)

    def render(self, running: int, waiting: int, graph_captures: int) -> str:
        """The Prometheus text exposition (format 0.0.4)."""
        with self.lock:
            families = [
                ("treeflash_requests_total", "counter", "Requests answered, by outcome.",
                 [({"outcome": k}, v) for k, v in self.requests.items()]),
                ("treeflash_request_seconds", "histogram", "Request time from arrival to answer, queueing included.",
                 self.request_seconds.samples()),
                ("treeflash_time_to_first_token_seconds", "histogram",
                 "Time from a request's arrival to its first generated token.", self.first_token_seconds.samples()),
                ("treeflash_choices_total", "counter", "Generations (one per prompt and choice) finished, by reason.",
                 [({"finish_reason": k}, v) for k, v in self.choices.items()]),
                ("treeflash_prompt_tokens_total", "counter", "Prompt tokens of finished generations, once per prompt.",
                 [({}, self.prompt_tokens)]),
                ("treeflash_generation_tokens_total", "counter", "Tokens generated.", [({}, self.generated_tokens)]),
                ("treeflash_generation_rounds_total", "counter",
                 "Rounds (target forwards, the prefill included) of finished generations, counted per generation "
                 "(a forward over a batch counts once for each generation in it): generation tokens divided by "
                 "this is tau.", [({}, self.generation_rounds)]),
                ("treeflash_requests_running", "gauge", "Requests in the engine now.", [({}, running)]),
                ("treeflash_requests_waiting", "gauge", "Requests queued for the engine.", [({}, waiting)]),
                ("treeflash_graph_captures_total", "counter", "CUDA graphs captured (warm-up included).",
                 [({}, graph_captures)]),
            ]
        lines = []
        for name, kind, help_, samples in families:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
            for labels, value in samples:
                value = str(value) if isinstance(value, int) else repr(float(value))
                if isinstance(labels, str):  # a histogram's suffix: _bucket{le=...}, _sum, _count
                    lines.append(f"{name}{labels} {value}")
                else:
                    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
                    lines.append(f"{name}{{{text}}} {value}" if text else f"{name} {value}")
        return "\n".join(lines) + "\n"
