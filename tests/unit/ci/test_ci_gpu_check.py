"""The GPU check's pieces that can be checked without a GPU: its cases exist in the harness and
start together on one H200, and the wheelhouse leaves out what the image has and slims Ray."""

import zipfile

from packaging.requirements import Requirement

from ci import gpu_check, gpu_wheels
from ci.cases import case_from_dict
from ci.gpu_shares import ShareSpec, on_shares
from ci.scheduler import make_plan


def test_the_checks_cases_are_the_harness_one_gpu_cases_and_all_start_at_once_on_an_h200():
    for scale, tier in (("gpu", "gpu"), ("cpu", "cpu")):
        entries = gpu_check.suite_entries(scale)
        assert [e["name"] for e in entries] == gpu_check.case_names(scale)
        assert {e["tier"] for e in entries} == {tier} and {e["gpus"] for e in entries} == {1}
        cases = on_shares([case_from_dict(e) for e in entries], ShareSpec(gpu_check.SHARES, 139.0))
        plan = make_plan([c.job for c in cases], range(gpu_check.SHARES), 1, iterations=20)
        assert {slot.start for slot in plan.slots} == {0.0}


def test_each_recipe_takes_the_scale_its_assets_are_made_at():
    for case in gpu_check.CASES:
        recipe = gpu_check.load_recipe(case.recipe)
        options = {"model_dir": "/m", "data_dir": "/d"}
        if case.scale:
            options["scale"] = case.scale
            assert case.scale in recipe._SCALES and "cpu-proxy" in recipe._SCALES
        assert recipe.ScriptArgs(**options).model_dir == "/m"


def test_the_wheelhouse_leaves_out_what_the_image_has_and_follows_markers_for_python_312():
    have = gpu_wheels.image_packages()
    assert {"torch", "transformers", "peft", "accelerate"} <= have and not {"ray", "diffusers"} & have
    assert gpu_wheels.applies(Requirement('tomli; python_version < "3.11"'), set()) is False
    assert gpu_wheels.applies(Requirement('x; python_version >= "3.12"'), set()) is True
    assert gpu_wheels.applies(Requirement('aiohttp-cors; extra == "default"'), {"default"}) is True
    assert gpu_wheels.applies(Requirement('aiohttp-cors; extra == "default"'), set()) is False


def test_slimming_drops_the_members_and_their_record_lines(tmp_path):
    wheel = tmp_path / "ray-9.0-cp312-cp312-manylinux2014_x86_64.whl"
    members = {"ray/__init__.py": b"x = 1\n", "ray/jars/ray_dist.jar": b"J" * 5000,
               "ray/dashboard/main.js.map": b"M" * 3000}
    record = "".join(gpu_wheels.record_line(n, d) + "\n" for n, d in members.items()) + "ray-9.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr("ray-9.0.dist-info/RECORD", record)
    assert gpu_wheels.slim(wheel, gpu_wheels.RAY_DROPPED) > 0
    with zipfile.ZipFile(wheel) as z:
        assert sorted(z.namelist()) == ["ray-9.0.dist-info/RECORD", "ray/__init__.py"]
        kept = z.read("ray-9.0.dist-info/RECORD").decode().splitlines()
    assert kept == [gpu_wheels.record_line("ray/__init__.py", b"x = 1\n"), "ray-9.0.dist-info/RECORD,,"]
