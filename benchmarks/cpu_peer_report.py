"""The Markdown page of a CPU peer benchmark (benchmarks/cpu_peer.py): its table, the ratio against
the peer's faster arm, the identical-workload checks and the deviations, from the result JSON alone."""
from __future__ import annotations


def markdown(r: dict) -> str:
    w = r["workload"]
    L = [f"# CPU peer benchmark — {r['date']}", "",
         f"Machine: {r['machine']['cpu']} ({r['machine']['cpu_count']} CPUs, shared; load average at start "
         f"{r['machine']['loadavg_start']}, at end {r['machine']['loadavg_end']}); torch threads {w['threads']} on both sides.",
         "",
         *([f"ISA: {' '.join(r['machine']['isa'])}; torch CPU capability {r['machine'].get('torch_cpu_capability')}; "
            f"{r['machine'].get('arch')}, {r['machine'].get('affinity')} CPUs usable by the process"
            + (f"; lscpu: {', '.join(f'{k} {v}' for k, v in r['machine']['lscpu'].items())}" if r['machine'].get('lscpu') else ""),
            ""] if r["machine"].get("isa") is not None else []),
         *([("Load average (1, 5, 15 min) through the run: "
             + "; ".join(f"{k} {v}" for k, v in r["machine"]["loadavg_during"].items())), ""]
           if r["machine"].get("loadavg_during") else []),
         f"Workload: tiny random Llama student (2 layers, d 64) and teacher (3 layers, d 96), SmolLM2 vocabulary "
         f"(49,152), fp32 on CPU; {w['prompts']} prompts x ({w['prompt_tokens']} prompt + {w['response']} forced "
         f"response tokens) per update, LoRA r16/alpha32 on 7 projections, direct forward_kl_topk k={w['topk']}, "
         f"{w['updates']} updates, medians over updates 2..{w['updates']}.", "",
         f"Command: `{r['command']}`", "",
         "| system | median s/update (wall) | rollout s | score s | update s | median CPU s/update | "
         "first update incl. construction s | process wall s / CPU s | process peak RSS GiB |",
         "|---|---|---|---|---|---|---|---|---|"]
    for s in r["systems"]:
        label = s["name"] + (f" [{s['run']}]" if s.get("run") else "")
        if "error" in s:
            first = next((ln for ln in s["error"].strip().splitlines()[::-1] if ln.strip()), "")
            L.append(f"| {label} | not run: {first[:200]} ||||||||")
            continue
        ph = s["median_phase_s"]
        L.append(f"| {label} | {s['median_update_s']} | {ph['rollout']} | {ph['score']} | {ph['update']} | "
                 f"{s.get('median_cpu_s_per_update')} | {s.get('first_update_incl_construction_s')} | "
                 f"{s['process']['wall_s']} / {s['process']['cpu_s']} | {s['process']['peak_rss_gib']} |")
    L += [""]
    c = r["comparison"]
    if c.get("ratio_ours_over_miniverl") is not None:
        L += [f"**Ours / miniVERL time per update: {c['ratio_ours_over_miniverl']}x** "
              f"(ours {c['ours_median_update_s']} s pooled over {c['ours_runs']} runs, vs miniVERL's faster arm "
              f"{c['miniverl_arm']}: {c['miniverl_median_update_s']} s). Target ≤ 0.5x: "
              f"{'met' if c['target_met'] else 'missed'}.", ""]
        if c.get("ratios_per_arm"):
            L += ["Per miniVERL arm (wall): " + ", ".join(f"{k}: {v}x" for k, v in c["ratios_per_arm"].items()), ""]
        L += ["Per phase vs that arm (wall): " + ", ".join(f"{k}: {v}x" for k, v in c["per_phase_ratio_vs_that_arm"].items()), ""]
        if c.get("cpu_ratios_per_arm"):
            L += [f"CPU time per update (less sensitive to the shared machine's load): ours {c['ours_median_cpu_s_per_update']} s; "
                  "ratio per arm: " + ", ".join(f"{k}: {v}x" for k, v in c["cpu_ratios_per_arm"].items())
                  + (f". CPU-time target ≤ 0.5x against every arm: {'met' if c['cpu_target_met'] else 'missed'}."
                     if "cpu_target_met" in c else ""), ""]
        if c.get("per_phase_cpu_ratio_vs_that_arm"):
            L += [f"Per phase, process CPU time vs the arm using the least CPU ({c['cpu_miniverl_arm']}): "
                  + ", ".join(f"{k}: {v}x" for k, v in c["per_phase_cpu_ratio_vs_that_arm"].items())
                  + f" (ours {c['ours_median_phase_cpu_s']} s)", ""]
    else:
        L += ["No ratio: " + c.get("why", "a side did not run"), ""]
    L += ["Identical-workload checks: " + ", ".join(f"{k}: {v}" for k, v in r["checks"].items()), ""]
    L += ["Deviations: " + " ".join(r["deviations"]), ""]
    L += ["Versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()), ""]
    L += ["Median process CPU s per phase: " + "; ".join(
        f"{s['name']}{' [' + s['run'] + ']' if s.get('run') else ''}: {s['median_phase_cpu_s']}"
        for s in r["systems"] if s.get("median_phase_cpu_s")), ""]
    L += ["Per-update wall times (s):", ""]
    for s in r["systems"]:
        if "error" not in s:
            L.append(f"- {s['name']}{' [' + s['run'] + ']' if s.get('run') else ''}: {s['step_wall_s']}")
    return "\n".join(L) + "\n"
