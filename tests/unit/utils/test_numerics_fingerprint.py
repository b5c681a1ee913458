"""The fingerprint names the CPU vendor: standards recorded on one vendor's CPU are not compared
bit for bit on the other's (MKL's reproducible path is Intel's; docs/testing.md, Fingerprints)."""

from miles.utils.numerics import cpu_info, fingerprint, fingerprint_changes


def test_the_fingerprint_carries_the_vendor_this_cpu_reports():
    vendor = cpu_info()["vendor"]
    assert fingerprint()["cpu_vendor"] == (vendor or None)
    assert vendor in ("GenuineIntel", "AuthenticAMD", "")  # x86-64 CI machines, or no /proc/cpuinfo


def test_another_vendor_is_named_as_an_environment_change():
    here = fingerprint()
    other = {**here, "cpu_vendor": "AuthenticAMD" if here["cpu_vendor"] != "AuthenticAMD" else "GenuineIntel"}
    assert fingerprint_changes(here, dict(here)) == []
    assert fingerprint_changes(here, other) == [f"CPU vendor {here['cpu_vendor']} -> {other['cpu_vendor']}"]
