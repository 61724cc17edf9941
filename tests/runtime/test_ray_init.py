"""`molt train` starts its local Ray instance again when Ray's fixed 30 s node start-up times out (a loaded
machine), and passes any other failure through."""

import pytest

from molt.config import MoltConfig
from molt.runtime import cluster


class FakeRay:
    def __init__(self, failures):
        self.failures, self.inits, self.shutdowns = list(failures), 0, 0

    def init(self, *args, **kwargs):
        self.inits += 1
        if self.failures:
            raise self.failures.pop(0)

    def shutdown(self):
        self.shutdowns += 1


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    def install(failures):
        fake = FakeRay(failures)
        monkeypatch.setattr(ray, "init", fake.init)
        monkeypatch.setattr(ray, "shutdown", fake.shutdown)
        return fake

    return install


TIMEOUT = Exception("The current node timed out during startup. This could happen because ...")


def test_a_startup_timeout_is_retried(fake_ray, capsys):
    fake = fake_ray([TIMEOUT, TIMEOUT])
    cluster.init_ray(MoltConfig())
    assert (fake.inits, fake.shutdowns) == (3, 2)
    assert capsys.readouterr().err.count("did not start in time") == 2


def test_it_gives_up_after_the_attempts(fake_ray):
    fake = fake_ray([TIMEOUT] * 3)
    with pytest.raises(Exception, match="timed out during startup"):
        cluster.init_ray(MoltConfig())
    assert fake.inits == 3


def test_other_failures_are_not_retried(fake_ray):
    fake = fake_ray([ValueError("bad num_cpus")])
    with pytest.raises(ValueError, match="bad num_cpus"):
        cluster.init_ray(MoltConfig())
    assert fake.inits == 1
