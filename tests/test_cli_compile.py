"""`deepinfer compile` end to end through the CLI, and its one-line errors."""
import time

from deepinfer.cli import main
from deepinfer.codegen.plan import load_plan


def test_compile_tiny_cpu_with_dump(tmp_path, capsys):
    rc = main(["compile", "--model", "v4.1-flash-tiny", "--target", "cpu", "-o", str(tmp_path / "plan"),
               "--dump-ir", str(tmp_path / "ir"), "--max-model-len", "2048"])
    out = capsys.readouterr().out
    assert rc == 0 and "calls per template" in out and "peak activation memory" in out
    assert load_plan(tmp_path / "plan")["options"]["max_pages"] == 16
    assert (tmp_path / "ir" / "08-select_kernels.ir").read_text().count("@kernel=") > 300


def test_compile_real_model_cpu_under_two_minutes(tmp_path, capsys):
    t = time.perf_counter()
    assert main(["compile", "--model", "v4.1-flash", "--target", "cpu", "-o", str(tmp_path / "plan")]) == 0
    assert time.perf_counter() - t < 120
    plan = load_plan(tmp_path / "plan", target="cpu")
    assert len(plan["graphs"]["step"]["calls"]) > 1500 and len(plan["load_program"]) == 40 + 3


def test_compile_errors_are_one_line(tmp_path, capsys):
    assert main(["compile", "--model", "v4.1-flash-tiny", "--target", "tpu", "-o", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "deepinfer: error: unknown target 'tpu' (known: sm90, sm100, ascend950, cpu)"
    assert main(["compile", "--model", str(tmp_path / "nowhere"), "--target", "cpu", "-o", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nowhere" in err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    assert main(["compile", "--model", str(bad), "--target", "cpu", "-o", str(tmp_path / "p")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "p").exists()


def test_compile_never_replaces_a_directory_of_user_files(tmp_path, capsys):
    """-o naming a directory that holds files but no plan is refused (a plan directory is replaced
    whole, which would delete them); an existing plan is replaced."""
    user = tmp_path / "mine"
    (user / "sub").mkdir(parents=True)
    (user / "notes.txt").write_text("keep me")
    (user / "sub" / "data.bin").write_bytes(b"x")
    assert main(["compile", "--model", "v4.1-flash-tiny", "--target", "cpu", "-o", str(user)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds files and no plan" in err
    assert (user / "notes.txt").read_text() == "keep me" and (user / "sub" / "data.bin").read_bytes() == b"x"
    plan = tmp_path / "plan"
    for _ in range(2):  # a second compile replaces the first plan
        assert main(["compile", "--model", "v4.1-flash-tiny", "--target", "cpu", "-o", str(plan),
                     "--max-model-len", "512"]) == 0
    assert load_plan(plan)["options"]["max_model_len"] == 512


def test_compile_keeps_user_files_beside_or_posing_as_a_plan(tmp_path, capsys):
    """A plan.json that is not a DeepInfer plan, or files beside a real plan's own, are the
    user's: refused before compiling, one line, nothing deleted. --dump-ir inside the plan
    directory (the replace would delete the dumps) is refused too; -o through a symbolic link
    writes the plan where the link points and keeps the link."""
    fake = tmp_path / "proj"
    fake.mkdir()
    (fake / "plan.json").write_text('{"name": "x"}')
    (fake / "thesis.tex").write_text("keep me")
    args = ["compile", "--model", "v4.1-flash-tiny", "--target", "cpu", "--max-model-len", "512", "-o"]
    assert main(args + [str(fake)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a DeepInfer plan" in err
    assert (fake / "thesis.tex").read_text() == "keep me"
    plan = tmp_path / "plan"
    assert main(args + [str(plan)]) == 0
    capsys.readouterr()
    (plan / "notes.txt").write_text("mine")
    assert main(args + [str(plan)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "notes.txt beside its plan" in err and (plan / "notes.txt").read_text() == "mine"
    (plan / "notes.txt").unlink()
    assert main(args + [str(plan), "--dump-ir", str(plan / "ir-dumps")]) == 2
    assert "--dump-ir" in capsys.readouterr().err and not (plan / "ir-dumps").exists()
    link = tmp_path / "link"
    link.symlink_to(plan, target_is_directory=True)
    assert main(args + [str(link)]) == 0
    assert link.is_symlink() and load_plan(plan)["options"]["max_model_len"] == 512
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
