"""The fingerprint names the CPU vendor: standards recorded on one vendor's CPU are not compared
bit for bit on the other's (MKL's reproducible path is Intel's; docs/testing.md, Fingerprints)."""

from miles.utils.numerics import cpu_info, fingerprint, fingerprint_changes


def test_the_fingerprint_carries_the_vendor_this_cpu_reports():
    vendor = cpu_info()["vendor"]
    assert fingerprint()["cpu_vendor"] == (vendor or None)
    assert vendor in ("GenuineIntel", "AuthenticAMD", "")  # x86-64 CI machines, or no /proc/cpuinfo


def test_another_vendor_is_named_as_an_environment_change():
    intel = fingerprint()
    amd = {**intel, "cpu_vendor": "AuthenticAMD" if intel["cpu_vendor"] != "AuthenticAMD" else "GenuineIntel"}
    assert fingerprint_changes(intel, dict(intel)) == []
    assert fingerprint_changes(intel, amd) == [f"CPU vendor {intel['cpu_vendor']} -> {amd['cpu_vendor']}"]
