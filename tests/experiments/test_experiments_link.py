"""The link line of a report (the link itself is tested in tests/test_link.py)."""

from __future__ import annotations

from xgrad.experiments.link import link_description
from xgrad.reference.clock import LinkModel


def test_link_description_names_the_link() -> None:
    assert "simulated" in link_description("sim", LinkModel(1e-6, 1e-9))
    assert "infinite bandwidth" in link_description("sim", LinkModel(1e-6, 0.0))
    assert "loopback" in link_description("real")
    assert "virtual clock" in link_description("virtual", LinkModel(1e-6, 1e-9))
