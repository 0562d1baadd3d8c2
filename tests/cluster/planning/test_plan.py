"""The planner without Ray: the simulator's timing against hand-computed schedules, the step-model fit, the search,
the YAML it writes, and `raypd plan` end to end on a small profile."""

from __future__ import annotations

import dataclasses
import math

import pytest
import yaml

from cluster.cli import main
from cluster.config import load_config
from cluster.planning.plan import Grid, Outcome, Profile, Workload, fit, plan_yaml, profile, requests_of, search, simulate
from cluster.planning.simulator import EngineShape, Overheads, SimRequest, Simulation, StepModel

# step seconds = 1 ms + 10 us per token + 100 us per sequence (no attention terms): easy to add up by hand
MODEL = StepModel((1e-3, 1e-5, 1e-4, 0.0, 0.0))
SHAPE = EngineShape(block_size=4, num_blocks=1024, max_num_batched_tokens=64, max_num_seqs=4)


def _prompt(n: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(10 + (seed * 7919 + i * 31) % 3000 for i in range(n))


def _step(tokens: int, seqs: int) -> float:
    return 1e-3 + 1e-5 * tokens + 1e-4 * seqs


def test_one_request_colocated_is_a_prefill_step_then_one_decode_step_per_token():
    [r] = Simulation(SHAPE, MODEL, 0, 1).run([SimRequest(0.0, _prompt(40), 5)])
    assert r.ttft_s == pytest.approx(_step(40, 1))
    assert r.tpot_s == pytest.approx(_step(1, 1))
    assert r.done_s == pytest.approx(_step(40, 1) + 4 * _step(1, 1))


def test_a_prompt_over_the_token_budget_is_prefilled_in_chunks():
    [r] = Simulation(SHAPE, MODEL, 0, 1).run([SimRequest(0.0, _prompt(100), 2)])
    assert r.ttft_s == pytest.approx(_step(64, 1) + _step(36, 1))


def test_max_num_seqs_makes_the_fifth_request_wait_for_a_seat():
    requests = [SimRequest(0.0, _prompt(8, i), 3) for i in range(5)]
    records = Simulation(SHAPE, MODEL, 0, 1).run(requests)
    first_four = _step(32, 4)
    assert all(r.ttft_s == pytest.approx(first_four) for r in records[:4])
    # the fifth is admitted once the first four finish: their two decode steps, then its own prefill
    assert records[4].ttft_s == pytest.approx(first_four + 2 * _step(4, 4) + _step(8, 1))


def test_disaggregated_first_token_comes_from_prefill_and_decode_starts_after_the_handoff():
    overheads = Overheads(ttft_s=0.005, step_scale=2.0, seq_step_s=0.0005, handoff_s=0.003)
    [r] = Simulation(SHAPE, MODEL, 1, 1, overheads).run([SimRequest(0.0, _prompt(40), 3)])
    prefill, decode = _step(40, 1), 2 * _step(1, 1) + 0.0005  # the serving path slows decode steps only
    assert r.ttft_s == pytest.approx(prefill + 0.005)
    assert r.done_s == pytest.approx(prefill + 0.003 + 2 * decode)
    assert r.tpot_s == pytest.approx((0.003 + 2 * decode) / 2)


def test_a_concurrency_cap_sends_the_next_request_when_the_client_sees_one_end():
    requests = [SimRequest(0.0, _prompt(8, i), 2) for i in range(3)]
    records = Simulation(SHAPE, MODEL, 0, 1, Overheads(ttft_s=0.002), concurrency=1).run(requests)
    for before, after in zip(records, records[1:]):
        assert after.sent_s == pytest.approx(before.done_s + 0.002)


def test_routing_spreads_requests_over_prefill_replicas():
    requests = [SimRequest(0.0, _prompt(60, i), 2) for i in range(2)]
    one = Simulation(SHAPE, MODEL, 1, 1).run(requests)
    two = Simulation(SHAPE, MODEL, 2, 1).run(requests)
    assert max(r.ttft_s for r in two) == pytest.approx(_step(60, 1))  # each on its own replica
    assert max(r.ttft_s for r in one) > max(r.ttft_s for r in two)


def test_fit_recovers_the_step_model_it_was_sampled_from():
    truth = StepModel((2e-3, 3e-5, 5e-5, 1e-8, 1e-6))
    samples = [((1.0, t, s, a, d), sum(c * f for c, f in zip(truth.coefficients, (1.0, t, s, a, d))))
               for t, s, a, d in [(1, 1, 0, 100), (8, 8, 0, 900), (64, 64, 0, 8000), (128, 1, 16000, 0),
                                  (512, 1, 260000, 0), (1024, 4, 270000, 0), (300, 20, 40000, 2400), (33, 33, 0, 5)]]
    # a repeat of a step slowed by another process counts at the step's fastest time
    slowed = [(f, 3 * t) for f, t in samples[::2]]
    model, error = fit(slowed + samples)
    assert error < 1e-6
    assert model.coefficients == pytest.approx(truth.coefficients, rel=1e-4)


def _profile(**overheads) -> Profile:
    return Profile("tiny", SHAPE, MODEL, 0.0, 0, 1, overheads)


def test_search_recommends_the_fewest_replicas_that_meet_the_slos():
    requests = [SimRequest(i * 0.003, _prompt(60, i), 16) for i in range(40)]
    outcomes, best = search(_profile(), requests, slo_ttft_ms=6.0, slo_tpot_ms=2.0, max_replicas=4)
    assert best is not None and best.attainment >= 0.9
    assert all(o.replicas >= best.replicas for o in outcomes if o.attainment >= 0.9)
    # two colocated replicas mix prefills into decode steps and miss the TTFT SLO; a prefill replica fixes it
    assert next(o for o in outcomes if (o.num_prefill, o.num_decode) == (0, 2)).attainment < 0.9
    assert (best.num_prefill, best.num_decode) == (1, 2)
    _, impossible = search(_profile(), requests, slo_ttft_ms=0.1, slo_tpot_ms=2.0, max_replicas=3)
    assert impossible is None


def test_plan_yaml_is_a_valid_deployment_with_the_counts(tmp_path, tiny_llama):
    source = tmp_path / "in.yaml"
    source.write_text(yaml.safe_dump({"model": tiny_llama, "decode": {"autoscaling": {"max_replicas": 3}},
                                      "router": {"policy": "prefix_aware"}}))
    from benchmarks.workload import Percentiles
    best = Outcome(2, 3, Percentiles(1, 1, 1, 1), Percentiles(1, 1, 1, 1), 1.0, 5.0, 10.0)
    out = tmp_path / "plan.yaml"
    out.write_text(plan_yaml(source, best))
    config = load_config(out)
    assert (config.mode, config.prefill.replicas, config.decode.replicas) == ("disaggregated", 2, 3)
    assert config.decode.autoscaling is None and config.router.policy.value == "prefix_aware"
    colocated = dataclasses.replace(best, num_prefill=0)
    out.write_text(plan_yaml(source, colocated))
    assert load_config(out).mode == "colocated"


def test_profile_of_the_tiny_model_predicts_its_steps(tiny_llama, tmp_path):
    config = load_config(_yaml(tmp_path, tiny_llama))
    grid = Grid(prefill_lengths=(16, 128), prefill_batches=(1, 4), decode_batches=(1, 8), decode_contexts=(32, 256),
                mixed=((4, 64, 128),), repeats=2)
    got = profile(config, grid)
    assert got.fit_error < 0.25 and got.num_steps > 20
    assert got.shape.max_num_batched_tokens == config.engine.max_num_batched_tokens
    # a longer prefill takes longer, and a decode step is cheaper than a prefill of many tokens
    requests = requests_of(Workload(input_len=32, output_len=4, num_requests=4, request_rate=math.inf), config)
    outcome = simulate(got, requests, 0, 1)
    assert outcome.ttft_ms.p50 > outcome.tpot_ms.p50 > 0


def _yaml(tmp_path, model: str):
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"model": model, "engine": {"num_threads": 1, "kv_cache_bytes": "32MiB",
                                                                "max_num_batched_tokens": 256}}))
    return path


def test_plan_command_prints_the_candidates_and_writes_the_yaml(tiny_llama, tmp_path, capsys):
    saved = tmp_path / "profile.json"
    _profile().save(saved)
    assert Profile.load(saved) == _profile()
    out = tmp_path / "plan.yaml"
    rc = main(["plan", str(_yaml(tmp_path, tiny_llama)), "--profile", str(saved), "--slo-ttft-ms", "50",
               "--slo-tpot-ms", "5", "--request-rate", "20", "--num-requests", "40", "--input-len", "32",
               "--output-len", "8", "--max-replicas", "3", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "recommended:" in text and "| prefill | decode |" in text
    assert load_config(out).decode.replicas >= 1
    assert main(["plan", str(_yaml(tmp_path, tiny_llama)), "--profile", str(saved), "--slo-ttft-ms", "0.01",
                 "--slo-tpot-ms", "5", "--num-requests", "10", "--max-replicas", "2", "--out", str(out)]) == 1
    assert "no deployment of up to 2 replicas meets the SLOs" in capsys.readouterr().err


def test_the_ttft_overhead_grows_with_the_requests_in_flight_on_average():
    requests = [SimRequest(0.0, _prompt(8, 0), 50), SimRequest(0.001, _prompt(8, 1), 2)]
    plain = Simulation(SHAPE, MODEL, 1, 1).run(requests)
    loaded = Simulation(SHAPE, MODEL, 1, 1, Overheads(ttft_per_request_s=0.004)).run(requests)
    # in flight on average: the two requests' time from sending to their last token, over the run's span
    busy = sum(r.done_s - r.sent_s for r in plain)
    load = busy / (max(r.done_s for r in plain) - min(r.sent_s for r in plain))
    assert 1.0 < load < 2.0
    for before, after in zip(plain, loaded):
        assert after.ttft_s == pytest.approx(before.ttft_s + 0.004 * load)
        assert after.done_s == pytest.approx(before.done_s)  # it is the serving path's wait: engine time is unchanged
    # twice the rate of the same requests: more of them in flight at once, so more added to each TTFT
    dense = [SimRequest(i * 0.005, _prompt(8, i), 20) for i in range(8)]
    sparse = [dataclasses.replace(r, arrival_s=r.arrival_s * 20) for r in dense]
    o = Overheads(ttft_per_request_s=0.004)
    extra = [sum(a.ttft_s - b.ttft_s for a, b in zip(Simulation(SHAPE, MODEL, 1, 1, o).run(reqs),
                                                      Simulation(SHAPE, MODEL, 1, 1).run(reqs)))
             for reqs in (dense, sparse)]
    assert extra[0] > extra[1] > 0


def _poisson(rate: float, n: int, seed: int) -> list[SimRequest]:
    import random

    rng, now, out = random.Random(seed), 0.0, []
    for i in range(n):
        out.append(SimRequest(now, _prompt(rng.randint(24, 56), seed * 1000 + i), rng.randint(8, 24)))
        now += rng.expovariate(rate)
    return out


@pytest.mark.parametrize(("rates", "step_scale", "seq_step_s"), [
    ((40.0, 160.0), 1.6, 0.0004),
    ((40.0, 100.0, 160.0), 1.6, 0.0004),
    ((40.0, 160.0), 3.0, 0.002),  # slower steps, more sequences batched
])
def test_the_overhead_fit_reproduces_the_p50s_of_known_overheads(rates, step_scale, seq_step_s):
    from benchmarks.plan_check import _fit_overheads

    truth = Overheads(ttft_s=0.004, step_scale=step_scale, seq_step_s=seq_step_s, ttft_per_request_s=0.0008)
    prof = Profile("m", SHAPE, MODEL, 0.0, 0, 1)
    points = []
    for i, rate in enumerate(rates):
        reqs = _poisson(rate, 60, i)
        got = simulate(dataclasses.replace(prof, overheads={"colocated": truth}), reqs, 0, 1)
        points.append((reqs, got.ttft_ms.p50, got.tpot_ms.p50))
    fitted = dataclasses.replace(prof, overheads={"colocated": _fit_overheads(prof, "colocated", points)})
    for reqs, ttft, tpot in points:
        sim = simulate(fitted, reqs, 0, 1)
        assert sim.ttft_ms.p50 == pytest.approx(ttft, rel=0.05)
        assert sim.tpot_ms.p50 == pytest.approx(tpot, rel=0.05)


def test_plan_refuses_a_single_calibration_rate(tiny_llama, tmp_path, capsys):
    code = main(["plan", str(_yaml(tmp_path, tiny_llama)), "--slo-ttft-ms", "100", "--slo-tpot-ms", "10",
                 "--calibrate", "2"])
    assert code != 0
    assert "--calibrate needs two or more request rates" in capsys.readouterr().err
