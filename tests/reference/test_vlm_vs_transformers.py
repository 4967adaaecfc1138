"""vlm against transformers' LlavaForConditionalGeneration on a tiny random
config (CLIP vision tower, LLaMA language model) saved by transformers: logits,
loss and every gradient in fp32, with the image token widened to the visual
tokens as LLaVA's processor does; wick's weights load back into transformers;
a sample with two image tokens is an error naming it."""
import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

VOCAB, IMAGE = 61, 60
RECIPE = """
local wick = require "wick"
local a = wick.args
local model = wick.model("vlm", { path = a.path, freeze_vision = a.freeze_vision == true,
  frame_tokens = a.frame_tokens, frame_chunk = a.frame_chunk, time_pool = a.time_pool })
wick.core.predict(model, a.batch, a.logits)
wick.core.gradients(model, a.batch, a.grads)
model:save(a.saved)
"""


def tiny(layer, strategy, tie=False):
    vision = transformers.CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=3, num_attention_heads=4)
    text = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                    num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                    rms_norm_eps=1e-5, tie_word_embeddings=tie)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE,
                                   vision_feature_layer=layer, vision_feature_select_strategy=strategy,
                                   projector_hidden_act="gelu")
    return transformers.LlavaForConditionalGeneration(cfg).float().eval()


def run_recipe(tmp_path, run_wick, *extra):
    """RECIPE on tmp_path's hf folder and batch: logits, gradients, saved weights."""
    (tmp_path / "r.lua").write_text(RECIPE)
    run_wick("run", tmp_path / "r.lua", f"path={tmp_path / 'hf'}", f"batch={tmp_path / 'batch.safetensors'}",
             f"logits={tmp_path / 'logits.safetensors'}", f"grads={tmp_path / 'grads.safetensors'}",
             f"saved={tmp_path / 'wick.safetensors'}", *extra)


def widen_image_tokens(ids, x, fill, count):
    """LLaVA's processor: each row's image token becomes `count` of them (x's
    entries there: fill)."""
    rows = []
    for r in range(ids.shape[0]):
        p = int((ids[r] == IMAGE).nonzero())
        rows.append(torch.cat([x[r, :p], torch.full((count,), fill, dtype=x.dtype), x[r, p + 1:]]))
    return torch.stack(rows)


@pytest.mark.parametrize("layer,strategy", [(-2, "default"), (-1, "full")])
def test_vlm_matches_llava(tmp_path, run_wick, layer, strategy):
    torch.manual_seed(0)
    ref = tiny(layer, strategy)
    with torch.no_grad():  # some spread in every norm and bias
        for n, p in ref.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    V = 16 + (strategy == "full")
    B, L = 2, 9
    ids = torch.randint(0, IMAGE, (B, L))
    ids[0, 2] = IMAGE  # the image token: after a short prefix ...
    ids[1, 0] = IMAGE  # ... and first
    labels = ids.clone()
    labels[ids == IMAGE] = -100
    labels[0, :2] = -100  # a masked prompt
    pixels = torch.randn(B, 3, 32, 32)
    save_file({"input_ids": ids, "labels": labels, "pixel_values": pixels}, tmp_path / "batch.safetensors")
    run_recipe(tmp_path, run_wick)

    def widen(x, fill):
        return widen_image_tokens(ids, x, fill, V)

    out = ref(input_ids=widen(ids, IMAGE), pixel_values=pixels, labels=widen(labels, -100))
    out.loss.backward()
    logits = load_file(tmp_path / "logits.safetensors")["output"]
    assert logits.shape == out.logits.shape
    assert (logits - out.logits.detach()).abs().max().item() < 1e-4
    g = load_file(tmp_path / "grads.safetensors")
    assert abs(g["loss"].item() - out.loss.item()) < 1e-5
    assert g["items"].item() == int((widen(labels, -100)[:, 1:] != -100).sum())
    checked = 0
    for n, p in ref.named_parameters():
        if p.grad is None or p.grad.abs().max() == 0:
            continue
        torch.testing.assert_close(g["grad." + n], p.grad, rtol=1e-4, atol=1e-5, msg=n)
        checked += 1
    assert checked > 40 and any(k.startswith("grad.model.vision_tower.") for k in g)

    # wick's weights are LLaVA's: they load back (strict) and give the same logits
    back = tiny(layer, strategy)
    back.load_state_dict(load_file(tmp_path / "wick.safetensors"), strict=True)
    with torch.no_grad():
        again = back(input_ids=widen(ids, IMAGE), pixel_values=pixels).logits
    assert (again - out.logits.detach()).abs().max().item() < 1e-5


def test_two_image_tokens_is_an_error(tmp_path, run_wick):
    torch.manual_seed(1)
    tiny(-2, "default").save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids = torch.randint(0, IMAGE, (2, 6))
    ids[0, 0] = IMAGE
    ids[1, 0] = ids[1, 3] = IMAGE
    save_file({"input_ids": ids, "pixel_values": torch.randn(2, 3, 32, 32)}, tmp_path / "batch.safetensors")
    (tmp_path / "r.lua").write_text('local wick = require "wick"\n'
                                    'local m = wick.model("vlm", { path = wick.args.path })\n'
                                    'wick.core.predict(m, wick.args.batch, wick.args.out)\n')
    p = run_wick("run", tmp_path / "r.lua", f"path={tmp_path / 'hf'}", f"batch={tmp_path / 'batch.safetensors'}",
                 f"out={tmp_path / 'o.safetensors'}", check=False)
    assert p.returncode != 0
    assert "sample 1" in p.stderr and "2 image tokens" in p.stderr


def test_video_frames_become_visual_tokens_frame_after_frame(tmp_path, run_wick):
    """A video batch [N, T, 3, H, W]: every frame's patch tokens, in frame
    order, stand at the image token. LLaVA given the N x T frames as images
    and T x V image tokens in a row computes the same (its image features fill
    the image tokens in order)."""
    torch.manual_seed(2)
    ref = tiny(-2, "default")
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    B, T, L, V = 2, 3, 7, 16
    ids = torch.randint(0, IMAGE, (B, L))
    ids[0, 1] = IMAGE
    ids[1, 3] = IMAGE
    labels = ids.clone()
    labels[ids == IMAGE] = -100
    video = torch.randn(B, T, 3, 32, 32)  # floating: taken as normalised
    save_file({"input_ids": ids, "labels": labels, "video": video}, tmp_path / "batch.safetensors")
    run_recipe(tmp_path, run_wick)

    def widen(x, fill):
        return widen_image_tokens(ids, x, fill, T * V)

    out = ref(input_ids=widen(ids, IMAGE), pixel_values=video.flatten(0, 1), labels=widen(labels, -100))
    logits = load_file(tmp_path / "logits.safetensors")["output"]
    assert logits.shape == out.logits.shape == (B, L - 1 + T * V, VOCAB)
    assert (logits - out.logits.detach()).abs().max().item() < 1e-4
    g = load_file(tmp_path / "grads.safetensors")
    assert abs(g["loss"].item() - out.loss.item()) < 1e-5


@pytest.mark.parametrize("same", [False, True])
def test_a_tied_config_with_its_own_lm_head_weight_does_what_transformers_does(tmp_path, run_wick, same):
    """text_config.tie_word_embeddings true, and the file holds a head of its
    own: transformers leaves the head untied and uses the file's when it
    differs from the token embedding (saying so), and ties it when it is the
    same; wick's vlm gives the same logits and says so too, as decoder_lm does."""
    torch.manual_seed(6)
    ref = tiny(-2, "default", tie=True)
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    embed_name = next(k for k in weights if k.endswith("embed_tokens.weight"))
    # save_pretrained's names (language_model.model.*, language_model.lm_head) or transformers 5's (model.language_model.*, lm_head)
    head_name = "lm_head.weight" if embed_name.startswith("model.") else "language_model.lm_head.weight"
    assert not any(k.endswith("lm_head.weight") for k in weights)
    embed = weights[embed_name]
    weights[head_name] = embed.clone() if same else torch.randn_like(embed) * 4
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    loaded = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(loaded.lm_head.weight, weights[head_name])
    ids = torch.randint(0, IMAGE, (2, 7))
    ids[:, 1] = IMAGE
    pixels = torch.randn(2, 3, 32, 32)
    save_file({"input_ids": ids, "pixel_values": pixels}, tmp_path / "batch.safetensors")
    (tmp_path / "p.lua").write_text('local wick = require "wick"\n'
                                    'local m = wick.model("vlm", { path = wick.args.path })\n'
                                    'wick.core.predict(m, wick.args.batch, wick.args.out)\n')
    p = run_wick("run", tmp_path / "p.lua", f"path={tmp_path / 'hf'}", f"batch={tmp_path / 'batch.safetensors'}",
                 f"out={tmp_path / 'o.safetensors'}")
    with torch.no_grad():
        want = loaded(input_ids=widen_image_tokens(ids, ids, IMAGE, 16), pixel_values=pixels).logits
        tied = ref(input_ids=widen_image_tokens(ids, ids, IMAGE, 16), pixel_values=pixels).logits
    assert same or (want - tied).abs().max().item() > 1e-2  # the case tells the two readings apart
    got = load_file(tmp_path / "o.safetensors")["output"]
    assert (got - want).abs().max().item() < 1e-4
    assert ("stays a separate output head, as transformers leaves it" in p.stderr) == (not same)


@pytest.mark.parametrize("freeze", [False, True])
def test_pooled_frames_in_chunks_equal_a_written_out_reference(tmp_path, run_wick, freeze):
    """frame_tokens = 4 (each frame's 4x4 patch grid averaged in 2x2 squares),
    time_pool = 2 (frames 0-1 averaged, frame 2 alone), frame_chunk = 2 (the 6
    frames through the tower two at a time): logits, loss and gradients equal
    transformers' tower, the pooling written out here, the projector and the
    language model fed those embeddings; a frozen tower gives the same logits."""
    torch.manual_seed(3)
    ref = tiny(-2, "default")
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    B, T, L = 2, 3, 7
    ids = torch.randint(0, IMAGE, (B, L))
    ids[0, 1] = IMAGE
    ids[1, 4] = IMAGE
    labels = ids.clone()
    labels[ids == IMAGE] = -100
    video = torch.randn(B, T, 3, 32, 32)
    save_file({"input_ids": ids, "labels": labels, "video": video}, tmp_path / "batch.safetensors")
    run_recipe(tmp_path, run_wick, "frame_tokens=4", "frame_chunk=2", "time_pool=2", f"freeze_vision={str(freeze).lower()}")

    # the reference, step by step
    hs = ref.model.vision_tower(video.flatten(0, 1), output_hidden_states=True).hidden_states[-2]
    grid = hs[:, 1:].reshape(B * T, 4, 4, -1)  # [frames, row, col, D]
    pooled = (grid[:, 0::2, 0::2] + grid[:, 1::2, 0::2] + grid[:, 0::2, 1::2] + grid[:, 1::2, 1::2]) / 4
    pooled = pooled.reshape(B, T, 4, -1)
    timed = torch.stack([(pooled[:, 0] + pooled[:, 1]) / 2, pooled[:, 2]], 1).reshape(B, 8, -1)
    feats = ref.model.multi_modal_projector(timed)
    emb = ref.model.get_input_embeddings()(ids.masked_fill(ids == IMAGE, 0))
    rows, lab = [], []
    for r in range(B):
        p = int((ids[r] == IMAGE).nonzero())
        rows.append(torch.cat([emb[r, :p], feats[r], emb[r, p + 1:]]))
        lab.append(torch.cat([labels[r, :p], torch.full((8,), -100), labels[r, p + 1:]]))
    h = ref.model.language_model(inputs_embeds=torch.stack(rows)).last_hidden_state
    want = ref.lm_head(h)
    y = torch.stack(lab)[:, 1:].reshape(-1)
    loss = torch.nn.functional.cross_entropy(want[:, :-1].reshape(-1, VOCAB), y, ignore_index=-100)
    loss.backward()

    logits = load_file(tmp_path / "logits.safetensors")["output"]
    assert logits.shape == want.shape == (B, L - 1 + 8, VOCAB)
    assert (logits - want.detach()).abs().max().item() < 1e-4
    g = load_file(tmp_path / "grads.safetensors")
    assert abs(g["loss"].item() - loss.item()) < 1e-5
    checked = 0
    for n, p in ref.named_parameters():
        if p.grad is None or p.grad.abs().max() == 0:
            continue
        if freeze and n.startswith("model.vision_tower."):
            assert "grad." + n not in g or g["grad." + n].abs().max() == 0
            continue
        torch.testing.assert_close(g["grad." + n], p.grad, rtol=1e-4, atol=1e-5, msg=n)
        checked += 1
    assert checked > 20
    assert any(k.startswith("grad.model.vision_tower.") for k in g) != freeze


def test_clips_of_different_lengths_equal_each_clip_alone(tmp_path, run_wick):
    """A batch of clips of 3 and 1 frames, padded to 3 with noise that
    frame_mask marks as padding (video_folder's max_frames = 0): each row's
    logits are transformers' on that clip alone (its own frames pooled, its
    own visual token count, no padding), and the loss and every gradient are
    those of the rows' summed token losses over all their answer tokens."""
    torch.manual_seed(5)
    ref = tiny(-2, "default")
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    B, T, L = 2, 3, 7
    counts = [3, 1]
    ids = torch.randint(0, IMAGE, (B, L))
    ids[0, 2] = IMAGE
    ids[1, 0] = IMAGE
    labels = ids.clone()
    labels[ids == IMAGE] = -100
    video = torch.randn(B, T, 3, 32, 32)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    save_file({"input_ids": ids, "labels": labels, "video": video, "frame_mask": mask}, tmp_path / "batch.safetensors")
    run_recipe(tmp_path, run_wick, "frame_tokens=4", "frame_chunk=2", "time_pool=2")

    total, items, lengths, want = 0.0, 0, [], []
    for r in range(B):
        n = counts[r]
        hs = ref.model.vision_tower(video[r, :n], output_hidden_states=True).hidden_states[-2]
        grid = hs[:, 1:].reshape(n, 4, 4, -1)
        pooled = ((grid[:, 0::2, 0::2] + grid[:, 1::2, 0::2] + grid[:, 0::2, 1::2] + grid[:, 1::2, 1::2]) / 4).reshape(n, 4, -1)
        groups = [pooled[t:t + 2].mean(0) for t in range(0, n, 2)]
        feats = ref.model.multi_modal_projector(torch.cat(groups, 0))
        emb = ref.model.get_input_embeddings()(ids[r:r + 1].masked_fill(ids[r:r + 1] == IMAGE, 0))[0]
        p = int((ids[r] == IMAGE).nonzero())
        row = torch.cat([emb[:p], feats, emb[p + 1:]])
        lab = torch.cat([labels[r, :p], torch.full((feats.shape[0],), -100), labels[r, p + 1:]])
        out = ref.lm_head(ref.model.language_model(inputs_embeds=row[None]).last_hidden_state)[0]
        total = total + torch.nn.functional.cross_entropy(out[:-1], lab[1:], ignore_index=-100, reduction="sum")
        items += int((lab[1:] != -100).sum())
        lengths.append(row.shape[0])
        want.append(out.detach())
    assert lengths == [L - 1 + 8, L - 1 + 4]
    loss = total / items
    loss.backward()

    logits = load_file(tmp_path / "logits.safetensors")["output"]
    assert logits.shape == (B, max(lengths), VOCAB)
    for r in range(B):
        assert (logits[r, :lengths[r]] - want[r]).abs().max().item() < 1e-4, r
    g = load_file(tmp_path / "grads.safetensors")
    assert int(g["items"]) == items
    assert abs(g["loss"].item() - loss.item()) < 1e-5
    checked = 0
    for n, p in ref.named_parameters():
        if p.grad is None or p.grad.abs().max() == 0:
            continue
        torch.testing.assert_close(g["grad." + n], p.grad, rtol=1e-4, atol=1e-5, msg=n)
        checked += 1
    assert checked > 20

    # a mask that is not [B, T] 0/1 with a frame in every clip is refused by name
    for bad, says in ((torch.tensor([[1, 1, 1]]), "frame_mask must be [N, T] = [2, 3]"),
                      (torch.tensor([[1, 2, 0], [1, 0, 0]]), "values other than 0 and 1"),
                      (torch.tensor([[1, 1, 1], [0, 0, 0]]), "clip 1 of the batch has no frame"),
                      (torch.tensor([[1.0, 1, 1], [1, 0, 0]]), "must hold integers or booleans")):
        save_file({"input_ids": ids, "labels": labels, "video": video, "frame_mask": bad}, tmp_path / "batch.safetensors")
        p = run_wick("run", tmp_path / "r.lua", f"path={tmp_path / 'hf'}", f"batch={tmp_path / 'batch.safetensors'}",
                     f"logits={tmp_path / 'l2.safetensors'}", f"grads={tmp_path / 'g2.safetensors'}",
                     f"saved={tmp_path / 's2.safetensors'}", check=False)
        assert p.returncode != 0 and says in p.stderr and "vlm:" in p.stderr, p.stderr
        assert not (tmp_path / "l2.safetensors").exists()


def tiny_family(family):
    """A LLaVA whose language model is `family`'s, made by transformers' own
    config classes: Mistral and Qwen2 with a sliding window shorter than the
    visual tokens, Qwen3 with q/k norms and its own head_dim, Phi-3 with fused
    projections and partial rotation."""
    vision = transformers.CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4)
    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    if family == "mistral":
        text = transformers.MistralConfig(**common, sliding_window=7)
    elif family == "qwen2":
        text = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=7, max_window_layers=1)
    elif family == "qwen3":
        text = transformers.Qwen3Config(**common, head_dim=12)
    else:
        common["rope_parameters"]["partial_rotary_factor"] = 0.5
        text = transformers.Phi3Config(**common, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE,
                                   vision_feature_layer=-2, vision_feature_select_strategy="default",
                                   projector_hidden_act="gelu")
    return transformers.LlavaForConditionalGeneration(cfg).float().eval()


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "phi3"])
def test_vlm_with_each_language_family_matches_llava(tmp_path, run_wick, family):
    """The vlm's language model is any decoder family a LLaVA folder names:
    logits, loss and every gradient equal transformers', with the window
    sliding over the visual tokens; the weights load back strict."""
    torch.manual_seed(1)
    ref = tiny_family(family)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    V, B, L = 16, 2, 9
    ids = torch.randint(0, IMAGE, (B, L))
    ids[0, 2] = IMAGE
    ids[1, 0] = IMAGE
    labels = ids.clone()
    labels[ids == IMAGE] = -100
    pixels = torch.randn(B, 3, 32, 32)
    save_file({"input_ids": ids, "labels": labels, "pixel_values": pixels}, tmp_path / "batch.safetensors")
    run_recipe(tmp_path, run_wick)

    def widen(x, fill):
        return widen_image_tokens(ids, x, fill, V)

    out = ref(input_ids=widen(ids, IMAGE), pixel_values=pixels, labels=widen(labels, -100))
    out.loss.backward()
    logits = load_file(tmp_path / "logits.safetensors")["output"]
    assert logits.shape == out.logits.shape
    assert (logits - out.logits.detach()).abs().max().item() < 1e-4, family
    g = load_file(tmp_path / "grads.safetensors")
    assert abs(g["loss"].item() - out.loss.item()) < 1e-5
    checked = 0
    for n, p in ref.named_parameters():
        if p.grad is None or p.grad.abs().max() == 0:
            continue
        torch.testing.assert_close(g["grad." + n], p.grad, rtol=1e-4, atol=1e-5, msg=n)
        checked += 1
    assert checked > 30
    back = tiny_family(family)
    back.load_state_dict(load_file(tmp_path / "wick.safetensors"), strict=True)


SAVE = """
local wick = require "wick"
local a = wick.args
local model = wick.model("vlm", { path = a.path, frame_tokens = a.frame_tokens })
if a.lora then wick.optim("lora", { r = 4 }):apply(model) end
local ok, err = pcall(wick.save_pretrained, model, a.out, a.lora and { merge = true } or nil)
print(ok and "SAVED" or ("REFUSED " .. err))
"""


@pytest.mark.parametrize("lora", [False, True])
def test_save_pretrained_writes_a_llava_folder_transformers_loads(tmp_path, run_wick, lora):
    """wick.save_pretrained of a vlm writes LLaVA's config.json (the tower's
    and the language model's configs, the image token, the feature layer and
    strategy) and its weights under transformers' names, with the source
    folder's tokenizer and image processor files: LlavaForConditionalGeneration
    loads it with no key missing or unexpected and computes the source
    model's logits. A video vlm that pools patches or frames is refused,
    naming the option LLaVA's config cannot describe."""
    torch.manual_seed(1)
    ref = tiny(-2, "default")
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32).save_pretrained(tmp_path / "hf")
    (tmp_path / "save.lua").write_text(SAVE)
    extra = ["lora=true"] if lora else []
    out = run_wick("run", tmp_path / "save.lua", f"path={tmp_path / 'hf'}", f"out={tmp_path / 'saved'}", *extra).stdout
    assert "SAVED" in out, out
    assert (tmp_path / "saved" / "preprocessor_config.json").exists()
    back, info = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    cfg = back.config
    assert cfg.image_token_id == IMAGE and cfg.vision_feature_layer == -2
    assert cfg.vision_feature_select_strategy == "default" and cfg.text_config.num_key_value_heads == 2
    ids = torch.randint(0, IMAGE, (2, 9))
    ids[:, 3] = IMAGE
    ids = widen_image_tokens(ids, ids, IMAGE, 16)
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = ref(input_ids=ids, pixel_values=pixels).logits
        got = back.float().eval()(input_ids=ids, pixel_values=pixels).logits
    assert (got - want).abs().max().item() < 1e-5
    # frames pooled to 4 tokens: no LLaVA config computes that
    out = run_wick("run", tmp_path / "save.lua", f"path={tmp_path / 'hf'}", f"out={tmp_path / 'video'}",
                   "frame_tokens=4").stdout
    assert "REFUSED" in out and "has no Hugging Face config" in out and "frame_tokens = 4" in out, out
    assert not (tmp_path / "video").exists()
