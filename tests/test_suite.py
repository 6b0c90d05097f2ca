"""Suites: the shipped suite files, their readers on files laid out exactly as GLUE and JGLUE distribute them, the
scoreboard's rules against hand-computed values, and a suite run again skipping what it finished."""

import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bertforge.data import tabular
from bertforge.data.choices import read_choices
from bertforge.data.questions import read_questions
from bertforge.data.suites import load_suite, pick_tasks, task_files
from bertforge.errors import UserError
from bertforge.tasks import scoreboard, suite
from bertforge.tasks.suite import SuiteConfig, Unit, prepared_files

ROOT = Path(__file__).resolve().parent.parent

# GLUE's files as its download script writes them: a header but CoLA's, tabs, quotes as plain text.
GLUE = {
    "CoLA/train.tsv": "gj04\t1\t\tOur friends won't buy this analysis, let alone the next one we propose.\n"
    "gj04\t0\t*\tThey drank the pub.\n",
    "CoLA/dev.tsv": "gj04\t1\t\tThe sailors rode the breeze clear of the rocks.\n",
    "SST-2/train.tsv": "sentence\tlabel\nhide new secretions from the parental units \t0\n",
    "SST-2/dev.tsv": "sentence\tlabel\nit 's a charming and often affecting journey . \t1\n",
    "MRPC/train.tsv": "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    '1\t702876\t702977\tAmrozi accused his brother , whom he called " the witness " .\tReferring to him as only " '
    'the witness " , Amrozi accused his brother .\n',
    "MRPC/dev.tsv": "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t1\t2\tA cat .\tA dog .\n",
    "STS-B/train.tsv": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    '0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\t"A plane is taking off.\tAn air plane is taking off.'
    "\t5.000\n",
    "STS-B/dev.tsv": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    "0\tmain-captions\tMSRvid\t2012test\t0000\tnone\tnone\tA man with a hard hat is dancing.\tA man wearing a "
    "hard hat is dancing.\t5.000\n",
    "QQP/train.tsv": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n133273\t213221\t213222\tHow is the life of "
    "a math student?\tWhich level of prepration is enough?\t0\n",
    "QQP/dev.tsv": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n1\t1\t2\tWhy?\tWhy not?\t1\n",
    "MNLI/train.tsv": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
    "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label\n"
    "0\t31193\t31193n\tgovernment\t( x )\t( y )\t(ROOT x)\t(ROOT y)\tConceptually cream skimming has two basic "
    "dimensions.\tProduct and geography are what make cream skimming work.\tneutral\tneutral\n",
    "MNLI/dev_matched.tsv": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
    "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n"
    "0\t63735\t63735n\tslate\t( x )\t( y )\t(ROOT x)\t(ROOT y)\tThe new rights are nice enough\tEveryone really "
    "likes the newest benefits\tneutral\tentailment\tneutral\tneutral\tneutral\tneutral\n",
    "QNLI/train.tsv": "index\tquestion\tsentence\tlabel\n0\tWhen did the third Digimon series begin?\tUnlike the two "
    "seasons before it, the series was set in the real world.\tnot_entailment\n",
    "QNLI/dev.tsv": "index\tquestion\tsentence\tlabel\n0\tWhat came into force?\tThe treaty did.\tentailment\n",
    "RTE/train.tsv": "index\tsentence1\tsentence2\tlabel\n0\tNo Weapons of Mass Destruction Found in Iraq Yet.\t"
    "Weapons of Mass Destruction Found in Iraq.\tnot_entailment\n",
    "RTE/dev.tsv": "index\tsentence1\tsentence2\tlabel\n0\tDana Reeve died.\tChristopher Reeve had an accident.\t"
    "not_entailment\n",
}
GLUE["MNLI/dev_mismatched.tsv"] = GLUE["MNLI/dev_matched.tsv"]

JGLUE = {
    "jsts-v1.3/train-v1.3.json": {
        "sentence_pair_id": "0", "yjcaptions_id": "10005_480798-10996-92616",
        "sentence1": "川べりでサーフボードを持った人たちがいます。",
        "sentence2": "トイレの壁に黒いタオルがかけられています。", "label": 0.0},
    "jnli-v1.3/train-v1.3.json": {
        "sentence_pair_id": "0", "yjcaptions_id": "100124-104404-104405",
        "sentence1": "二人の男性がジャンボジェット機を見ています。",
        "sentence2": "2人の男性が、白い飛行機を眺めています。", "label": "neutral"},
    "jcommonsenseqa-v1.3/train-v1.3.json": {
        "q_id": 0, "question": "主に子ども向けのもので、イラストのついた物語が書かれているものはどれ？",
        "choice0": "世界", "choice1": "写真集", "choice2": "絵本", "choice3": "論文", "choice4": "図鑑", "label": 2},
}  # fmt: skip
CONTEXT = "東海道新幹線 [SEP] 1987年（昭和62年）4月1日の国鉄分割民営化により、JR東海が運営を継承した。"
SQUAD = {"version": "v1.3", "data": [{"title": "東海道新幹線", "paragraphs": [{"context": CONTEXT, "qas": [
    {"id": "a1000888p0q0", "question": "2020年、東海道新幹線の運営を継承したのは？", "is_impossible": False,
     "answers": [{"text": "JR東海", "answer_start": CONTEXT.index("JR東海")}]}]}]}]}  # fmt: skip


def write_glue(root: Path) -> Path:
    for rel, text in GLUE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return root


def write_jglue(root: Path) -> Path:
    for rel, row in JGLUE.items():
        for split in ("train", "valid"):
            path = root / rel.replace("train", split)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    for split in ("train", "valid"):
        (root / "jsquad-v1.3").mkdir(parents=True, exist_ok=True)
        (root / f"jsquad-v1.3/{split}-v1.3.json").write_text(json.dumps(SQUAD, ensure_ascii=False), encoding="utf-8")
    return root


def test_shipped_suites_parse_with_their_tasks():
    glue, jglue = load_suite("glue"), load_suite("jglue")
    assert list(glue.tasks) == ["cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte"]
    assert list(jglue.tasks) == ["jsts", "jnli", "jsquad", "jcommonsenseqa"]
    assert glue.tasks["cola"].metrics == ("matthews",) and glue.tasks["stsb"].metrics == ("pearson", "spearman")
    assert glue.tasks["mnli"].also == {"mismatched": "MNLI/dev_mismatched.tsv"}
    assert jglue.settings("jsquad") == {"max_length": 384, "epochs": 4.0, "batch_size": 32, "lrs": (2e-5, 3e-5, 5e-5)}
    # configs/suites is where the repository shows them; the package ships the same files.
    assert sorted(p.name for p in (ROOT / "configs/suites").glob("*.yaml")) == ["glue.yaml", "jglue.yaml"]
    assert pick_tasks(glue, "SST2, rte") == ["sst2", "rte"]
    with pytest.raises(UserError, match="--tasks: wnli not in suite glue"):
        pick_tasks(glue, "wnli")


def test_glue_files_as_distributed_are_read(tmp_path):
    data, glue = write_glue(tmp_path / "glue"), load_suite("glue")
    for short in glue.tasks:
        files = prepared_files(glue, short, str(data), tmp_path / "out")
        assert set(files) == {"train", "valid", *glue.tasks[short].also}
    # CoLA has no header: its rows are written once with its columns named.
    cola = prepared_files(glue, "cola", str(data), tmp_path / "out")
    assert cola["train"] == tmp_path / "out/data/cola/train.jsonl"
    _, rows = tabular.read_table(str(cola["train"]))
    assert [(r["label"], r["sentence"]) for r in rows] == [
        ("1", "Our friends won't buy this analysis, let alone the next one we propose."),
        ("0", "They drank the pub."),
    ]
    # Quotes are text in GLUE's TSVs, an unmatched one (STS-B) included.
    _, rows = tabular.read_table(str(data / "MRPC/train.tsv"))
    assert rows[0]["#1 String"] == 'Amrozi accused his brother , whom he called " the witness " .'
    _, rows = tabular.read_table(str(data / "STS-B/train.tsv"))
    assert (rows[0]["sentence1"], rows[0]["score"]) == ('"A plane is taking off.', "5.000")
    _, rows = tabular.read_table(str(data / "MNLI/dev_matched.tsv"))
    assert rows[0]["gold_label"] == "neutral"


def test_jglue_files_as_distributed_are_read(tmp_path):
    data, jglue = write_jglue(tmp_path / "jglue"), load_suite("jglue")
    for short in jglue.tasks:
        assert prepared_files(jglue, short, str(data), tmp_path / "out") == task_files(jglue, short, str(data))
    _, rows = tabular.read_table(str(data / "jsts-v1.3/valid-v1.3.json"))
    assert rows[0]["label"] == 0.0
    assert read_choices(str(data / "jcommonsenseqa-v1.3/valid-v1.3.json"))[0].label == 2
    assert read_questions(str(data / "jsquad-v1.3/valid-v1.3.json"))[0].answers[0].text == "JR東海"


@pytest.mark.parametrize(
    "short, change, message",
    [
        (
            "rte",
            lambda d: (d / "RTE/dev.tsv").unlink(),
            r"RTE/dev.tsv: no such file \(RTE's valid file; glue is published at https://gluebenchmark.com/tasks\)",
        ),
        (
            "cola",
            lambda d: (d / "CoLA/dev.tsv").write_text("gj04\t1\tThe sailors rode.\n"),
            r"CoLA/dev.tsv: row 1 has 3 tab-separated field\(s\), its 4 columns \(source, label, original_label, "
            r"sentence; no header\)",
        ),
        (
            "sst2",
            lambda d: (d / "SST-2/dev.tsv").write_text("text\tlabel\nfine\t1\n"),
            r"SST-2/dev.tsv: no column 'sentence' \(SST-2 reads it; the file has 'text', 'label'\)",
        ),
        (
            "qnli",
            lambda d: (d / "QNLI/dev.tsv").write_bytes(b"index\tquestion\tsentence\tlabel\n0\t\xff\tb\tx\n"),
            r"QNLI/dev.tsv: line 2 is not UTF-8 text",
        ),
    ],
)
def test_malformed_glue_files_get_one_line(tmp_path, short, change, message):
    data, glue = write_glue(tmp_path / "glue"), load_suite("glue")
    change(data)
    with pytest.raises(UserError, match=message):
        prepared_files(glue, short, str(data), tmp_path / "out")


def test_a_suite_file_of_ones_own_is_checked(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nsource: here\ntasks:\n  a: {name: A, task: classification, train: a.csv, "
                    "valid: b.csv, text: t, target: y, metrics: [acuracy]}\n")  # fmt: skip
    with pytest.raises(UserError, match=rf"{path}: config 'tasks.a': metric 'acuracy': .*higher is better"):
        load_suite(str(path))
    path.write_text("name: mine\nsource: here\nsteps: 3\ntasks:\n  a: {name: A, task: classification, "
                    "train: a.csv, valid: b.csv, text: t, target: y, metrics: [accuracy]}\n")  # fmt: skip
    with pytest.raises(UserError, match=rf"{path}: unknown config key 'steps'"):
        load_suite(str(path))
    with pytest.raises(UserError, match="no suite named 'superglue' \\(shipped: glue, jglue"):
        load_suite("superglue")


def _two_task_suite(tmp_path: Path) -> Path:
    path = tmp_path / "two.yaml"
    path.write_text(
        "name: two\nsource: here\nseeds: 2\nlrs: [1.0e-5, 2.0e-5]\ntasks:\n"
        "  pairs: {name: Pairs, task: classification, train: t.csv, valid: v.csv, also: {other: o.csv}, text: a, "
        "pair: b, target: y, metrics: [f1, other_accuracy]}\n"
        "  grammar: {name: Grammar, task: classification, train: t.csv, valid: v.csv, text: a, target: y, "
        "metrics: [matthews], seeds: 1}\n"
    )
    return path


def test_scoreboard_against_hand_computed_values(tmp_path):
    two = load_suite(str(_two_task_suite(tmp_path)))
    results = {
        "pairs": [
            {"lr": 1e-5, "seed": 0, "metrics": {"f1": 0.80, "other_accuracy": 0.70}},
            {"lr": 1e-5, "seed": 1, "metrics": {"f1": 0.90, "other_accuracy": 0.60}},
            {"lr": 2e-5, "seed": 0, "metrics": {"f1": 0.84, "other_accuracy": 0.90}},
            {"lr": 2e-5, "seed": 1, "metrics": {"f1": 0.84, "other_accuracy": 0.90}},
        ],
        "grammar": [
            {"lr": 1e-5, "seed": 0, "metrics": {"matthews": 0.30}},
            {"lr": 2e-5, "seed": 0, "metrics": {"matthews": 0.50}},
        ],  # fmt: skip
    }
    board = scoreboard.scoreboard(two, "m", results)
    pairs, grammar = board["tasks"]["pairs"], board["tasks"]["grammar"]
    # lr 1e-5's f1 mean is 85 against 84: chosen by the main metric although 2e-5 scores more on the other set.
    assert pairs["lr"] == 1e-5 and pairs["seeds"] == pytest.approx([80.0, 90.0])
    assert pairs["mean"] == pytest.approx(85.0) and pairs["std"] == pytest.approx(7.0710678, rel=1e-6)
    assert pairs["other_accuracy"] == pytest.approx(65.0) and pairs["score"] == pytest.approx(75.0)
    assert grammar["lr"] == 2e-5 and grammar["score"] == pytest.approx(50.0) and grammar["std"] == 0.0
    assert board["average"] == pytest.approx(62.5) and board["all_tasks"]
    assert "| average (every task) | | 62.50 |" in scoreboard.markdown(board)


def _fake_finetune(calls: list[list[str]]) -> suite.Runner:
    """A runner that writes what finetune and evaluate write, with scores made from the lr and seed."""

    def run(cmd: list[str], log: Path, env: dict[str, str]) -> int:
        calls.append(cmd)
        flag = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in cmd if a.startswith("--") and "=" in a}
        out = Path(cmd[cmd.index("--out") + 1])
        if cmd[3] == "finetune":
            lr, seed = float(flag["--optim.lr"]), int(flag["--train.seed"])
            score = 0.5 + 1e4 * lr + 0.01 * seed
            out.mkdir(parents=True, exist_ok=True)
            metrics = {"f1": score, "accuracy": score - 0.1, "matthews": score - 0.2}
            (out / "summary.json").write_text(json.dumps({"out_of_fold": metrics}))
            (out / "fold-0/model").mkdir(parents=True, exist_ok=True)
        else:
            out.write_text(json.dumps({"accuracy": 0.6, "records": 3}))
        return 0

    return run


def test_a_suite_run_again_skips_finished_units_and_a_stopped_one_resumes(tmp_path):
    path = _two_task_suite(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    for name in ("t.csv", "v.csv", "o.csv"):
        (data / name).write_text("a,b,y\nx,z,1\n")
    cfg = SuiteConfig(suite=str(path), data=str(data), model="m", out=str(tmp_path / "out"))
    calls: list[list[str]] = []
    whole = suite.main(cfg, runner=_fake_finetune(calls))
    # pairs: 2 lrs x 2 seeds, each a finetune and an evaluate; grammar: 2 lrs x 1 seed.
    assert len(calls) == 2 * 2 * 2 + 2 and not list((tmp_path / "out/units").glob("*/*/run/fold-*/model"))
    assert "--head.metric=f1" in calls[0] and "--head.metric=matthews" in calls[-1]
    calls.clear()
    assert suite.main(cfg, runner=_fake_finetune(calls)) == whole and calls == []

    # A unit's process stopped by a signal (exit 143): the suite stops; run again, it finishes the rest.
    cfg = SuiteConfig(suite=str(path), data=str(data), model="m", out=str(tmp_path / "again"))
    stop_at = 5

    def stopping(cmd: list[str], log: Path, env: dict[str, str]) -> int:
        return 143 if len(calls) == stop_at else _fake_finetune(calls)(cmd, log, env)

    with pytest.raises(suite.Stopped):
        suite.main(cfg, runner=stopping)
    done = sorted(p.parent.name for p in (tmp_path / "again/units").glob("*/*/unit.json"))
    assert done == ["lr1e-05-seed0", "lr1e-05-seed1"]
    assert suite.main(cfg, runner=_fake_finetune(calls)) == whole
    assert Unit("pairs", 1e-5, 0).folder(Path("o")) == Path("o/units/pairs/lr1e-05-seed0")


def _suite_data(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    for name in ("t.csv", "v.csv", "o.csv"):
        (data / name).write_text("a,b,y\nx,z,1\n")
    return data


def test_units_at_once_over_devices_give_the_one_at_a_time_scoreboard(tmp_path):
    """Two slots (devices 0 and 1): two units run at once, each unit's finetune and evaluate see one device, and
    the scoreboard is the one units run one after another write; a stop in one, run again, finishes the rest."""
    path, data = _two_task_suite(tmp_path), _suite_data(tmp_path)
    alone = suite.main(SuiteConfig(suite=str(path), data=str(data), model="m", out=str(tmp_path / "one")),
                       runner=_fake_finetune([]))  # fmt: skip
    calls: list[list[str]] = []
    fake, lock, running, most = _fake_finetune(calls), threading.Lock(), [0], [0]
    seen: dict[str, set[str]] = {}

    def timed(cmd: list[str], log: Path, env: dict[str, str]) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            seen.setdefault(str(log.parent), set()).add(env["CUDA_VISIBLE_DEVICES"])
        time.sleep(0.05)  # long enough for the other slot's unit to start meanwhile
        with lock:
            running[0] -= 1
        return fake(cmd, log, env)

    cfg = SuiteConfig(suite=str(path), data=str(data), model="m", out=str(tmp_path / "two"), devices="0,1")
    assert suite.main(cfg, runner=timed) == alone
    assert most[0] == 2 and len(calls) == 10
    assert all(len(ids) == 1 for ids in seen.values()) and set().union(*seen.values()) == {"0", "1"}

    stop_at, again = 3, SuiteConfig(suite=str(path), data=str(data), model="m", out=str(tmp_path / "again"),
                                    devices="0,1")  # fmt: skip
    calls.clear()

    def stopping(cmd: list[str], log: Path, env: dict[str, str]) -> int:
        with lock:
            stop = len(calls) == stop_at
            calls.append([]) if stop else None
        return 143 if stop else fake(cmd, log, env)

    with pytest.raises(suite.Stopped):
        suite.main(again, runner=stopping)
    assert len(list((tmp_path / "again/units").glob("*/*/unit.json"))) < 6
    assert suite.main(again, runner=_fake_finetune([])) == alone


def test_device_slots():
    from bertforge.tasks.suite_units import device_slots

    assert device_slots("") == [{}]
    assert device_slots("0,1") == [{"CUDA_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0"},
                                   {"CUDA_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "1"}]  # fmt: skip
    shared = device_slots("0,0,1")
    assert [s["XLA_PYTHON_CLIENT_MEM_FRACTION"] for s in shared[:2]] == ["0.450", "0.450"]
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in shared[2]
    assert len(device_slots("all", count=lambda: 4)) == 4 and device_slots("all", count=lambda: 0) == [{}]
    with pytest.raises(UserError, match="--devices gpu0: give device ids such as 0,1,2,3"):
        SuiteConfig(suite="glue", data="d", model="m", out="o", devices="gpu0")


def test_suite_command_runs_finetune_and_evaluate_and_scores_them(tmp_path, model_dir):
    """The command end to end on the test model: one task with a second validation set, one lr and seed; its
    scores are finetune's and evaluate's own, and a second run reuses them."""
    data = tmp_path / "data"
    data.mkdir()
    rows = ["a,b,y"] + [f"{'river city' if i % 2 else 'music game'} {i},the {i},{i % 2}" for i in range(48)]
    for name in ("t.csv", "v.csv", "o.csv"):
        (data / name).write_text("\n".join(rows) + "\n")
    path = _two_task_suite(tmp_path)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bertforge.cli", "suite", "--suite", str(path), "--data", str(data), "--model",
           str(model_dir), "--out", str(out), "--tasks", "pairs", "--seeds", "1", "--lrs", "1e-3",
           "--train.epochs=1", "--train.batch_size=8"]  # fmt: skip
    first = subprocess.run(cmd, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    board = json.loads((out / "scoreboard.json").read_text())
    unit = out / "units/pairs/lr0.001-seed0"
    summary = json.loads((unit / "run/summary.json").read_text())
    other = json.loads((unit / "other.json").read_text())
    pairs = board["tasks"]["pairs"]
    assert pairs["seeds"] == [pytest.approx(100 * summary["out_of_fold"]["f1"])]
    assert pairs["other_accuracy"] == pytest.approx(100 * other["accuracy"])
    assert pairs["score"] == pytest.approx(statistics.mean([pairs["f1"], pairs["other_accuracy"]]))
    assert not (unit / "run/fold-0/model").exists() and (out / "scoreboard.png").stat().st_size > 0
    second = subprocess.run(cmd, capture_output=True, text=True)
    assert second.returncode == 0 and "(finished before)" in second.stdout
    assert json.loads((out / "scoreboard.json").read_text()) == board
