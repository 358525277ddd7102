"""The command line's conventions (issue 43): users' commands apart from the operator's, kubectl's
-n (the context's namespace), -A and -o table|wide|json|yaml, `version`, and a completion script
that bash itself runs."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvpersist import admin, cli, cliflags


def _subcommands(parser: object) -> set[str]:
    return set(cli.completion_commands(parser))  # type: ignore[arg-type]


def test_users_commands_and_the_operators_are_apart() -> None:
    assert _subcommands(cli.user_parser()) == {"status", "report", "gc", "plan", "pins", "convert", "version", "completion"}
    assert _subcommands(cli._operator_parser()) == set(cli.OPERATOR_COMMANDS)
    # Still answered by `kvpersist` (the image's entrypoint before, and every server's agent sidecar).
    assert cli.main(["crd"]) == 0


def _kubeconfig(tmp_path: Path, namespace: str | None) -> str:
    context = {"cluster": "c", "user": "u", **({"namespace": namespace} if namespace else {})}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "mine",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "mine", "context": context}, {"name": "other", "context": {**context, "namespace": "ops"}}]}))
    return str(path)


@pytest.mark.parametrize("command", ["status", "report", "gc", "plan"])
def test_namespace_is_the_contexts_unless_given_and_A_is_all(tmp_path: Path, command: str) -> None:
    parser = cli.user_parser()
    extra = {"gc": ["kvp-" + "0" * 32], "plan": ["-f", "x.yaml"]}.get(command, [])
    config = _kubeconfig(tmp_path, "team-a")
    assert cliflags.namespace_of(parser.parse_args([command, *extra, "--kubeconfig", config])) == "team-a"
    assert cliflags.namespace_of(parser.parse_args([command, *extra, "--kubeconfig", config, "--context", "other"])) == "ops"
    assert cliflags.namespace_of(parser.parse_args([command, *extra, "--kubeconfig", config, "-n", "b"])) == "b"
    if command != "plan":  # plan reads one file: -n is the namespace of objects that name none
        assert cliflags.namespace_of(parser.parse_args([command, *extra, "--kubeconfig", config, "-A"])) is None
    plain = _kubeconfig(tmp_path, None)
    assert cliflags.namespace_of(parser.parse_args([command, *extra, "--kubeconfig", plain])) == "default"


def test_every_output_format_is_accepted_and_others_refused() -> None:
    parser = cli.user_parser()
    for output in cliflags.OUTPUTS:
        assert parser.parse_args(["status", "-o", output]).output == output
        assert parser.parse_args(["report", "-o", output]).output == output
        assert parser.parse_args(["plan", "-f", "x.yaml", "-o", output]).output == output
    with pytest.raises(SystemExit):
        parser.parse_args(["status", "-o", "xml"])
    template = "jsonpath={range [*]}{.name}{end}"
    assert parser.parse_args(["report", "-o", template]).output == template
    assert parser.parse_args(["version", "-o", "jsonpath={.kvpersist}"]).output == "jsonpath={.kvpersist}"
    for bad in ("jsonpath={[*].name", "jsonpath={range [*]}{.name}", "jsonpath={.a b}", "jsonpath={..name}"):
        with pytest.raises(SystemExit):
            parser.parse_args(["status", "-o", bad])
    with pytest.raises(SystemExit):
        parser.parse_args(["version", "-o", "name"])  # version has no object to name


def test_name_and_jsonpath_print_as_kubectl() -> None:
    data = [{"namespace": "team-a", "name": "llama", **RESOURCE["status"]},
            {"namespace": "team-a", "name": "qwen", "phase": "Pending", "conditions": []}]
    assert cliflags.emit("name", data, lambda _: "", admin.kubectl_name) == ("kvcachenamespace.kvpersist.dev/llama\n"
                                                                             "kvcachenamespace.kvpersist.dev/qwen")
    assert cliflags.emit("name", [{"namespace_id": "kvp-1"}], lambda _: "", lambda r: r["namespace_id"]) == "kvp-1"
    assert cliflags.emit("jsonpath={[*].name}", data, lambda _: "") == "llama qwen"
    assert cliflags.jsonpath(r'{range [*]}{.name}{"\t"}{.phase}{"\n"}{end}', data) == "llama\tReady\nqwen\tPending\n"
    assert cliflags.jsonpath('{[*].conditions[?(@.type=="Ready")].reason}', data) == "AllReady"
    assert cliflags.jsonpath('{[?(@.phase!="Ready")].name}', data) == "qwen"
    rows = [{"orphan": True, "namespace_id": "kvp-1"}, {"orphan": False, "namespace_id": "kvp-2"}]
    assert cliflags.jsonpath("{[?(@.orphan==true)].namespace_id}", rows) == "kvp-1"  # docs/admin.md's example
    assert cliflags.jsonpath("{$[0].usage}", data) == '{"l1Used":"1Mi","l2Used":"2Gi"}'  # maps as JSON
    assert cliflags.jsonpath("{[5].name}{[-1]['name']}", data) == "qwen"  # out of range: nothing
    assert cliflags.jsonpath("{range [*]}{range .conditions[*]}{.type};{end}|{end}", data) == "Ready;||"


RESOURCE = {"metadata": {"namespace": "team-a", "name": "llama"},
            "status": {"phase": "Ready", "namespaceId": "kvp-" + "a" * 32, "usage": {"l1Used": "1Mi", "l2Used": "2Gi"},
                       "servers": [{"healthy": True}], "replicas": 2, "hits": {"summary": "50.0% (85s)"},
                       "conditions": [{"type": "Ready", "status": "True", "reason": "AllReady"}]}}


def test_status_table_wide_json_and_yaml() -> None:
    data = [{"namespace": "team-a", "name": "llama", **RESOURCE["status"]}]
    table = cliflags.emit("table", data, lambda wide: admin.format_status([RESOURCE], wide))
    wide = cliflags.emit("wide", data, lambda wide: admin.format_status([RESOURCE], wide))
    assert "REASON" not in table and "AllReady" not in table
    header, row = wide.splitlines()
    assert header.split()[-3:] == ["REASON", "VLLM", "HIT"] and "AllReady" in row and "50.0%" in row
    assert json.loads(cliflags.emit("json", data, lambda _: "")) == data
    assert yaml.safe_load(cliflags.emit("yaml", data, lambda _: "")) == data


def test_report_wide_adds_the_last_write_stamp() -> None:
    row = admin.Row("pvc/l2", "team-a/llama", "kvp-" + "b" * 32, 2048, 3, "2026-12-01T00:00:00Z", True, False)
    assert "LAST-WRITE-AT" not in admin.format_report([row], 0.0)
    assert admin.format_report([row], 0.0, wide=True).splitlines()[1].endswith("2026-12-01T00:00:00Z")


def test_version_prints_text_and_json(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                      tmp_path: Path) -> None:
    """The client's version, and the operators the cluster runs or, with no cluster to ask, why not
    in one line naming the fix; --client asks none; `kvpersist --version` too."""
    from kvpersist import __version__

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    assert cli.main(["version", "--client"]) == 0
    assert capsys.readouterr().out == f"client: kvpersist {__version__} (API kvpersist.dev/v1alpha1; lmcache 0.5.6)\n"
    assert cli.main(["version"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"client: kvpersist {__version__} ") and out[1].startswith("operator: unknown (no cluster to ask")
    assert "set KUBECONFIG or --kubeconfig" in out[1] and len(out) == 2
    assert cli.main(["version", "-o", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kvpersist"] == __version__ and data["operators"] == [] and "no cluster" in data["operatorsUnknown"]
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"kvpersist {__version__}\n"


def test_no_cluster_is_one_line_naming_the_fix(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    assert cli.main(["status"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: no cluster to ask") and "--kubeconfig" in err


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize(("words", "expected"), [
    (["kvpersist", "st"], {"status"}),
    (["kvpersist", "status", "--all"], {"--all-namespaces"}),
    (["kvpersist", "-h", "rep"], {"report"}),
    (["kvpersist", "plan", "--ki"], set()),  # plan has no such flag: nothing offered
])
def test_the_bash_completion_script_completes(words: list[str], expected: set[str]) -> None:
    """bash itself sources the script and runs its function on a command line, as it would on TAB."""
    script = cli.completion_script(cli.user_parser(), "bash")
    words_text = " ".join(f"'{w}'" for w in words)
    program = (f"{script}\nCOMP_WORDS=({words_text}); COMP_CWORD={len(words) - 1}\n"
               "_kvpersist_complete; printf '%s\\n' \"${COMPREPLY[@]}\"")
    done = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert {w for w in done.stdout.split() if w} == expected


def test_zsh_script_loads_bashcompinit_first() -> None:
    script = cli.completion_script(cli.user_parser(), "zsh")
    assert script.startswith("autoload -U +X bashcompinit && bashcompinit\n") and "complete -o default" in script


def test_the_api_reference_is_current_and_covers_every_field() -> None:
    """docs/api-reference.md is what the models generate (`kvpersist-operator api-reference --write`),
    and it names every leaf of the CRD's spec."""
    from kvpersist.api.crd import REFERENCE_PATH, build_crd, render_reference

    root = Path(__file__).resolve().parents[2]
    text = render_reference()
    assert (root / REFERENCE_PATH).read_text() == text, "stale: run `kvpersist-operator api-reference --write`"
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]

    def leaves(node: dict, path: str) -> list[str]:
        kids = node.get("properties") or (node.get("items") or {}).get("properties") or {}
        sep = "[]." if "items" in node and "properties" not in node else "."
        return [p for k, v in kids.items() for p in leaves(v, f"{path}{sep}{k}")] if kids else [path]

    missing = [p for p in leaves(spec, "spec") if f"| `{p}` |" not in text]
    assert not missing, missing


def test_run_logs_in_json_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """--log-format json (the chart's logFormat): kopf's JSON lines, each naming its resource under k8s."""
    import kopf

    from kvpersist.controller import runtime

    calls: dict[str, dict] = {}
    monkeypatch.setattr(kopf, "run", lambda **kw: calls.setdefault("run", kw))
    monkeypatch.setattr(kopf, "configure", lambda **kw: calls.setdefault("configure", kw))
    monkeypatch.setattr(runtime.CONTROLLER, "policy", runtime.CONTROLLER.policy)  # no global state left behind
    monkeypatch.setattr(runtime, "set_peering", lambda *_: None)
    monkeypatch.setattr(runtime, "quiet_event_handler_logs", lambda: None)
    monkeypatch.setenv("KVPERSIST_CLUSTER_DOMAIN", "cluster.local")
    assert cli.main(["run", "--standalone", "--log-format", "json"]) == 0
    assert calls["configure"]["log_format"] == kopf.LogFormat.JSON and calls["configure"]["log_refkey"] == "k8s"
    calls.clear()
    assert cli.main(["run", "--standalone"]) == 0
    assert calls["configure"]["log_format"] == kopf.LogFormat.FULL and "run" in calls
    with pytest.raises(SystemExit):
        cli.main(["run", "--log-format", "yaml"])


def test_name_and_jsonpath_of_nothing_print_nothing(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """As kubectl: no resource (or no report row) under -o name or jsonpath is no output, not a blank line."""
    monkeypatch.setattr(admin.kube, "list_all", lambda *_args, **_kwargs: [])  # no resource, no pod
    for output in ("name", "jsonpath={[*].name}"):
        assert admin.cmd_status("ml", output) == 0
        assert admin.cmd_report("ml", output) == 0
    assert capsys.readouterr().out == ""
    assert admin.cmd_report("ml", "json") == 0 and capsys.readouterr().out == "[]\n"
