"""What the engine replicas' processes start with (cluster/serving/app.py): engines that borrow idle cores get
libgomp's short spin, unless the operator exported their own."""

from cluster.config import parse_config
from cluster.serving.app import engine_env, one_loop_options
from engine.parallel.host_cores import BORROWING_ENV


def _config(borrow: bool):
    return parse_config({"model": "models/tiny-llama", "engine": {"num_threads": 1, "borrow_idle_cores": borrow}})


def test_borrowing_engines_start_with_a_short_openmp_spin(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = one_loop_options(_config(True).decode, engine_env(_config(True)))["ray_actor_options"]["runtime_env"]
    assert env["env_vars"] == {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", **BORROWING_ENV}
    assert engine_env(_config(False)) == {}


def test_an_exported_spin_count_is_left_to_the_operator(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert engine_env(_config(True)) == {}
