"""GET /metrics: the server's counters and gauges in Prometheus' text format (per stage: step and prompt-chunk
times, the expert caches; the queue, the requests, the tokens, the prompt cache)."""

from typing import TYPE_CHECKING

from engine.telemetry.prometheus import Family, render, summary
from engine.telemetry.stats import RunningStat, Telemetry
from installer.version import __version__

if TYPE_CHECKING:
    from engine.pipeline.batch import BatchRunner
    from engine.pipeline.generate import Runner
    from engine.pipeline.loader import LoadedModel
    from engine.pipeline.prompt_cache import PromptCache
    from engine.serve.jobs import Job


class Metrics:
    """Part of EngineService: reads its telemetry, model, runner, queue and links."""

    status: str
    lm: "LoadedModel | None"
    runner: "Runner | None"
    batch: "BatchRunner | None"
    running: "list[Job]"
    rows: RunningStat
    prompt_cache: "PromptCache | None"
    model_name: str
    telemetry: Telemetry
    active: "Job | None"

    @property
    def waiting(self) -> int:
        raise NotImplementedError

    @property
    def generating(self) -> int:
        raise NotImplementedError

    def links(self) -> list[tuple[str, str]]:
        raise NotImplementedError

    def metrics(self) -> str:
        snap = self.telemetry.snapshot()
        tot = snap["totals"]
        fams = [
            Family("strata_info", "gauge", "The model served, its architecture and device.").add(
                1,
                {
                    "model": self.model_name,
                    "arch": self.lm.config.arch if self.lm else "",
                    "device": str(self.lm.model.device) if self.lm else "",
                    "version": __version__,
                },
            ),
            Family("strata_model_ready", "gauge", "1 once the model is loaded and serving.").add(
                1 if self.status == "ready" else 0
            ),
            Family("strata_uptime_seconds", "gauge", "Seconds since the server started.").add(
                snap["uptime_s"]
            ),
        ]
        links = self.links()
        if links:
            up = Family(
                "strata_remote_stage_up", "gauge", "1 while the link to a remote stage works, by address."
            )
            for address, st in links:
                up.add(1 if st == "ok" else 0, {"address": address})
            fams.append(up)
        req = Family("strata_requests_total", "counter", "Requests finished, by endpoint and outcome.")
        for r in snap["requests"]:
            req.add(r["count"], {"endpoint": r["endpoint"], "outcome": r["outcome"]})
        fams.append(req)
        for name, key, help_ in (
            ("strata_prompt_tokens_total", "prompt_tokens", "Prompt tokens of finished requests."),
            (
                "strata_prompt_tokens_cached_total",
                "prompt_cached_tokens",
                "Prompt tokens reused from the prompt cache.",
            ),
            ("strata_tokens_predicted_total", "generated_tokens", "Tokens generated."),
            ("strata_prompt_seconds_total", "prompt_seconds", "Seconds spent reading prompts."),
            ("strata_tokens_predicted_seconds_total", "decode_seconds", "Seconds spent generating tokens."),
        ):
            fams.append(Family(name, "counter", help_).add(tot[key]))
        fams.append(
            Family("strata_queue_waiting", "gauge", "Requests waiting for the model.").add(self.waiting)
        )
        fams.append(
            Family("strata_requests_active", "gauge", "Requests being generated.").add(self.generating)
        )
        if self.batch is not None:
            fams.append(Family("strata_slots", "gauge", "Slots requests are decoded in together.").add(
                len(self.batch.slots)))  # fmt: skip
            fams.append(Family("strata_slots_busy", "gauge", "Slots holding a request.").add(self.batch.busy))
            r = self.rows
            fams.append(
                summary("strata_step_rows", "Token rows of one shared step.", [({}, r.count, r.total)])
            )
        stages = snap["stages"]
        fams.append(
            summary(
                "strata_step_seconds",
                "Time of one decode step, per pipeline stage.",
                [({"stage": s["stage"]}, s["step_ms"]["count"], s["step_ms"]["total"] / 1e3) for s in stages],
            )
        )
        fams.append(
            summary(
                "strata_prompt_chunk_seconds",
                "Time of one prompt chunk, per pipeline stage.",
                [
                    (
                        {"stage": s["stage"]},
                        s["prompt_chunk_ms"]["count"],
                        s["prompt_chunk_ms"]["total"] / 1e3,
                    )
                    for s in stages
                ],
            )
        )
        hits = Family(
            "strata_expert_cache_hits_total", "counter", "Expert lookups served from the card's cache."
        )
        miss = Family(
            "strata_expert_cache_misses_total", "counter", "Expert lookups that missed the card's cache."
        )
        swaps = Family(
            "strata_expert_cache_swaps_total", "counter", "Experts the adaptive swaps brought into VRAM."
        )
        moved = Family(
            "strata_expert_cache_bytes_moved_total",
            "counter",
            "Expert bytes copied into VRAM by adaptive swaps and prompt chunks' staging.",
        )
        on_cpu = Family(
            "strata_expert_cache_cpu_computed_total",
            "counter",
            "Missed experts computed on the CPU (--cpu-experts).",
        )
        share = Family(
            "strata_expert_cache_cpu_share",
            "gauge",
            "The CPU's share of a decode step's misses now (tuned while serving, or --cpu-ratio).",
        )
        for s in stages:
            ec, lab = s["expert_cache"], {"stage": s["stage"]}
            hits.add(ec["hits"], lab)
            miss.add(ec["misses"], lab)
            swaps.add(ec["swaps"], lab)
            moved.add(ec["bytes_moved"], lab)
            on_cpu.add(ec["computed_on_cpu"], lab)
            if ec["cpu_share"] is not None:
                share.add(ec["cpu_share"], lab)
        fams += [hits, miss, swaps, moved, on_cpu, share]
        counts = snap["expert_counts"]
        if counts:
            sel = Family("strata_expert_selections_total", "counter", "Routed expert selections, per layer.")
            for layer, row in enumerate(counts):
                sel.add(sum(row), {"layer": layer})
            fams.append(sel)
        pc = self.prompt_cache
        if pc is not None:
            s = pc.stats()
            fams.append(
                Family("strata_prompt_cache_bytes", "gauge", "Bytes of KV kept by the prompt cache.").add(
                    s.bytes
                )
            )
            fams.append(
                Family("strata_prompt_cache_entries", "gauge", "Sequences kept by the prompt cache.").add(
                    s.entries
                )
            )
            fams.append(
                Family(
                    "strata_prompt_cache_restores_total", "counter", "Prompt cache entries brought back."
                ).add(s.restores)
            )
        return render(fams)
