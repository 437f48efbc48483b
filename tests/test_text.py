"""Real text: synth's tokenizer and chat template, prompts through the checkpoint's own tokenizer
(AutoTokenizer) in golden and verify, and the one line a checkpoint without a tokenizer gets."""

import re
import shutil

import pytest
from transformers import AutoTokenizer

from gkbuild import chat_template, cli, text, verify
from gkbuild.checkpoint import hub, synth_tokenizer
from gkbuild.checkpoint.source import parse
from gkbuild.errors import GkError
from gkbuild.golden import Golden
from gkbuild.model import preset
from tests.conftest import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["tiny", "tiny-topology", "gpt-oss-120b"])
def test_synth_writes_a_tokenizer_that_fits_the_vocabulary(tmp_path, name):
    cfg = preset(name)
    synth_tokenizer.write(cfg, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = tok.get_vocab().values()
    assert max(ids) < cfg.V and len(tok) <= cfg.V
    if cfg.V <= synth_tokenizer.MAX_BPE + len(synth_tokenizer.SPECIALS):
        assert sorted(ids) == list(range(cfg.V))  # every id a tiny model predicts has a token
    assert tok.convert_tokens_to_ids("<|endoftext|>") == cfg.to_hf()["pad_token_id"]
    assert tok.convert_tokens_to_ids("<|return|>") == cfg.to_hf()["eos_token_id"]
    words = "The capital of France is Paris."
    enc = tok(words, add_special_tokens=False)["input_ids"]
    assert len(enc) < len(words) and tok.decode(enc) == words  # merges learned, and lossless
    chat = text.encode(tok, [words], chat=True)[0]
    start, message = tok.convert_tokens_to_ids("<|start|>"), tok.convert_tokens_to_ids("<|message|>")
    assert chat[0] == start and message in chat and chat[-1] == tok.encode("assistant", add_special_tokens=False)[-1]
    again = tmp_path / "again"
    again.mkdir()
    synth_tokenizer.write(cfg, again)  # deterministic
    assert (again / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()


def test_synthesized_checkpoints_carry_the_tokenizer(tiny_ckpt):
    assert all((tiny_ckpt / f).is_file() for f in synth_tokenizer.FILES)
    assert text.tokenizer(parse(str(tiny_ckpt))).chat_template


def test_a_synth_source_gives_its_tokenizer_without_its_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("GKBUILD_CACHE", str(tmp_path / "cache"))
    tok = text.tokenizer(parse("synth://gpt-oss-120b?layers=36"))  # 36 layers of 120b: never synthesized here
    assert len(tok) > 8000 and not (tmp_path / "cache" / "synth").exists()


def test_golden_from_text_records_the_prompts_and_continues_the_shorter_ones(tiny_ckpt, tmp_path):
    out = tmp_path / "g.safetensors"
    prompts = ["The capital of France is", "Once upon a time there was a small village by the sea"]
    r = run_cli("golden", str(tiny_ckpt), "--out", str(out), "--prompt", prompts[0], "--prompt", prompts[1],
                "--steps", "2", "-q")
    assert r.returncode == 0, r.stderr
    g = Golden.load(out)
    tok = text.tokenizer(parse(str(tiny_ckpt)))
    ids = text.encode(tok, prompts)
    assert g.prompts == prompts and g.prompt_lens == [len(i) for i in ids] and g.meta["chat"] is False
    assert g.token_ids.shape == (2, max(map(len, ids)) + 2)
    for p, want in enumerate(ids):
        assert g.token_ids[p, :len(want)].tolist() == want
    r = run_cli("golden", str(tiny_ckpt), "--out", str(tmp_path / "c.safetensors"), "--prompt", prompts[0], "--chat",
                "--steps", "1", "-q")
    assert r.returncode == 0, r.stderr
    chat = Golden.load(tmp_path / "c.safetensors")
    assert chat.meta["chat"] is True and chat.token_ids[0, 0] == tok.convert_tokens_to_ids("<|start|>")


def test_prompt_errors_are_one_line(tiny_copy, tmp_path):
    for f in synth_tokenizer.FILES:
        (tiny_copy / f).unlink()
    r = run_cli("golden", str(tiny_copy), "--out", str(tmp_path / "g.safetensors"), "--prompt", "hello")
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0
    assert "has no tokenizer" in r.stderr and "--prompt-ids" in r.stderr
    r = run_cli("golden", str(tiny_copy), "--out", str(tmp_path / "g.safetensors"), "--chat")
    assert r.returncode != 0 and "--chat" in r.stderr and "--prompt" in r.stderr
    r = run_cli("golden", str(tiny_copy), "--out", str(tmp_path / "g.safetensors"), "--prompt", "a",
                "--prompt-ids", "1,2")
    assert r.returncode != 0 and "use one of them" in r.stderr
    assert not (tmp_path / "g.safetensors").exists()


def test_a_hub_snapshot_with_a_tokenizer_serves_it_offline(tiny_ckpt, tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--gpt-oss-tiny"
    shutil.copytree(tiny_ckpt, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    spec = parse("hf://acme/gpt-oss-tiny@main")
    assert text.folder(spec) == repo / "snapshots" / commit
    assert text.local_tokenizer(spec) is not None
    assert hub.tokenizer_files(spec.uri, text.TOKENIZER_FILES) == repo / "snapshots" / commit


def test_verify_shows_each_sequence_as_text_beside_the_reference(tmp_path):
    from gkbuild import recipe
    from gkbuild.pipeline.pipeline import compile_build
    from tests.conftest import RECIPES

    out = tmp_path / "b"
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml"), out=out, quiet=True, compile=False)
    rep = verify.run(out, texts=["The capital of France is"], chat=True, steps=3)
    assert rep.ok, rep.to_dict()
    (t,) = rep.texts
    assert t["prompt"] == "The capital of France is" and t["length"] == 3 and t["agree"] == 3
    assert t["reference"] == t["build"] and "<" not in t["reference"]  # text, not token ids
    r = run_cli("verify", str(out), "--prompt", "Hello", "--steps", "2")
    assert r.returncode == 0, r.stderr
    assert "continuations" in r.stdout and "Hello" in r.stdout
    r = run_cli("verify", str(out), "--golden", "x.safetensors", "--prompt", "Hello")
    assert r.returncode != 0 and "--golden" in r.stderr


def test_encode_refuses_an_empty_prompt(tiny_ckpt):
    tok = text.tokenizer(parse(str(tiny_ckpt)))
    with pytest.raises(GkError, match="no tokens"):
        text.encode(tok, [""])
    assert text.decode(tok, [tok.convert_tokens_to_ids("<|start|>"), 10 ** 6]).endswith("<1000000>")


def test_a_prompt_longer_than_the_context_is_refused_from_its_token_count_before_any_model_work(built, monkeypatch):
    """The probe's 25,000-character prompt ran the reference for 105 s (17 GB) before the length
    check; the tokens are counted first now."""
    long = "The capital of France is Paris. " * 40  # ~200 tokens against tiny-cpu's max_context of 64
    r = run_cli("verify", str(built), "--prompt", long, "--steps", "2")
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "positions exceed the build's decode.max_context of 64" in r.stderr

    def no_model_work(*a, **k):
        raise AssertionError("the reference ran")
    monkeypatch.setattr("gkbuild.golden.for_checkpoint", no_model_work)
    with pytest.raises(GkError, match=r"\d+ positions exceed the build's decode.max_context of 64"):
        verify.run(built, texts=[long], steps=2)


def test_a_golden_the_reference_cannot_hold_is_refused_before_any_model_work(tmp_path, monkeypatch):
    """``golden`` has no build to bound its length: it refuses what the reference could not hold in
    this host's memory (or past the model's positions), counted from the tokens, before any work."""
    def no_model_work(*a, **k):
        raise AssertionError("the reference ran")
    monkeypatch.setattr("gkbuild.golden.for_checkpoint", no_model_work)
    monkeypatch.setattr("gkbuild.reference.host_memory", lambda: 24 << 30)
    out = tmp_path / "g.safetensors"
    long = "The capital of France is Paris. " * 5000  # 35,001 tokens: ~110 GiB of attention weights
    with pytest.raises(GkError, match=r"^1 sequences x 35017 positions need at least 110\.\d GiB for the reference "
                                      r"\(logits, hidden states, attention weights\), this host has 24\.0 GiB"):
        cli.cli.main(["golden", "synth://tiny", "--out", str(out), "--prompt", long], standalone_mode=False)
    with pytest.raises(GkError, match=r"^131073 positions \(the longest prompt plus 9 steps\) exceed the model's "
                                      r"max_position_embeddings of 131072$"):
        cli.cli.main(["golden", "synth://tiny", "--out", str(out), "--steps", "9", "--prompt-ids",
                  ",".join(["1"] * 131_064)], standalone_mode=False)
    assert not out.exists()


@pytest.mark.parametrize("name, content, match", [
    ("tokenizer.json", "[" * 100_000 + "]" * 100_000, "tokenizer.json: nested deeper than 64 levels"),
    ("tokenizer_config.json", '{"a":' * 5000 + "1" + "}" * 5000, "tokenizer_config.json: nested deeper than 64"),
    ("tokenizer_config.json", '{"added_tokens_decoder": [1, 2]}', "added_tokens_decoder is not a map of id"),
    ("tokenizer_config.json", '{"chat_template": 7}', "chat_template is not a template string"),
    ("tokenizer_config.json", '{"eos_token": ["x"]}', "eos_token is not a token"),
    ("tokenizer.json", '{"model": "BPE"}', "tokenizer.json: model is not an object"),
    ("tokenizer.json", '{"model": {"type": "BPE", "vocab": 5}}', "its tokenizer does not load"),
    ("tokenizer.json", '{"a": 1, "a": 2}', 'key "a" appears twice'),
])
def test_tokenizer_files_are_bounded_and_checked_like_every_json_read(tiny_copy, name, content, match):
    (tiny_copy / name).write_text(content)
    with pytest.raises(GkError, match=re.escape(match)) as e:
        text.tokenizer(parse(str(tiny_copy)))
    assert "\n" not in str(e.value)


def test_a_broken_tokenizer_through_the_cli_is_one_line(tiny_copy, tmp_path):
    (tiny_copy / "tokenizer_config.json").write_text('{"a":' * 5000 + "1" + "}" * 5000)
    r = run_cli("golden", str(tiny_copy), "--out", str(tmp_path / "g.safetensors"), "--prompt", "hi", "--chat")
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "nested deeper" in r.stderr, r.stderr
    assert not (tmp_path / "g.safetensors").exists()


LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_a_chat_template_that_fails_runs_away_or_renders_too_much_is_one_line_naming_its_file(tiny_copy):
    cases = [("{{ raise_exception('no such role') }}", "does not render (TemplateError: no such role)"),
             ("{% for %}", "does not render (TemplateSyntaxError:"),
             ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recurses too deeply"),
             ("{{ 'a' * 10000000000 }}", "ran out of memory"),
             ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "renders 10000000 characters"),
             (LOOP, f"did not finish rendering in {chat_template.CPU_SECONDS} s of CPU"),
             ("{{ ''.__class__.__mro__ }}", "does not render (SecurityError:")]  # the sandbox holds
    (tiny_copy / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tok = text.tokenizer(parse(str(tiny_copy)))
    for template, match in cases:
        tok.chat_template = template  # as if the file held it (one tokenizer load for every case)
        with pytest.raises(GkError, match=re.escape(match)) as e:
            text.encode(tok, ["hello"], chat=True)
        assert str(e.value).startswith(f"{tiny_copy / 'chat_template.jinja'}: the chat template") and \
            "\n" not in str(e.value), str(e.value)
