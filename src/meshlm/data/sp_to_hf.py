"""A SentencePiece ``.model`` as a Hugging Face ``tokenizers.Tokenizer`` (a tokenizer.json) that
gives the same ids, so transformers reads it without sentencepiece or protobuf (the export needs
both; the reader does not).

The ``.model`` file is a protobuf ``ModelProto`` (sentencepiece_model.proto): pieces (field 1),
``trainer_spec`` (2; its ``model_type`` is field 3: 1 unigram, 2 bpe; ``treat_whitespace_as_suffix``
24) and ``normalizer_spec`` (3: ``name`` 1, ``precompiled_charsmap`` 2, ``add_dummy_prefix`` 3,
``remove_extra_whitespaces`` 4, ``escape_whitespaces`` 5; the three flags default to true). Those
fields and each piece's ``type`` are read with sentencepiece's own ``sentencepiece_model_pb2``
(protobuf); the pieces and scores come from the sentencepiece library.

How SentencePiece encodes (what the tokenizer.json reproduces): the text is normalized by the
model's character map (none under the ``identity`` rule), then runs of spaces are squeezed and
the ends stripped (``remove_extra_whitespaces``), "▁" is put in front (``add_dummy_prefix``) and
every space becomes "▁"; the whole string is then cut by the model: unigram (Viterbi over the
piece scores) or BPE (repeatedly join the adjacent pair whose joined piece scores highest; a
tokenizers BPE does the same with merges ranked by that score). Characters outside the pieces
become byte pieces ``<0xNN>`` (byte fallback) or ``<unk>``. Control pieces (``<s>``, ``</s>``)
are never matched in text, user-defined pieces always are.

``to_tokenizers`` raises DataError (one line, naming the file) for what it cannot reproduce
(WORD/CHAR models, whitespace as a suffix, unescaped whitespace). One difference remains for
unigram models: a tokenizers Unigram may match a control piece written in the text (``</s>``),
which SentencePiece never does (BPE models exclude those pieces from the merges, so match none).
"""

from __future__ import annotations

from ..errors import DataError

_UNIGRAM, _BPE = 1, 2  # TrainerSpec.model_type
_USER_DEFINED = 4  # ModelProto.SentencePiece.Type


def model_spec(path: str) -> dict:
    """{"model_type": 1 unigram | 2 bpe | …, "suffix": treat_whitespace_as_suffix, "charsmap": bytes,
    "dummy_prefix", "squeeze_spaces", "escape_spaces": bool, "user_defined": [piece ids]} of the
    SentencePiece model file, parsed with the sentencepiece package's own ModelProto (which needs
    protobuf); DataError naming the file when it is not a readable model or protobuf is missing."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as e:
        raise DataError(f"{path}: reading a SentencePiece model's settings needs protobuf ({e}); "
                        f"pip install protobuf") from None
    model = sentencepiece_model_pb2.ModelProto()
    try:
        with open(path, "rb") as f:
            model.ParseFromString(f.read())
    except Exception as e:  # protobuf's DecodeError, or an OSError
        raise DataError(f"{path}: not a readable SentencePiece model ({e})") from None
    t, n = model.trainer_spec, model.normalizer_spec
    return {"model_type": t.model_type, "suffix": t.treat_whitespace_as_suffix, "charsmap": n.precompiled_charsmap,
            "dummy_prefix": n.add_dummy_prefix, "squeeze_spaces": n.remove_extra_whitespaces,
            "escape_spaces": n.escape_whitespaces,
            "user_defined": [i for i, piece in enumerate(model.pieces) if piece.type == _USER_DEFINED]}


def ranked_merges(vocab: dict, rank) -> list:
    """BPE merges [(left, right)] of a vocabulary {token: id}: every split of a token into two tokens,
    ordered by ``rank(token)`` (lower merges first), then by the ids of the two halves."""
    merges = []
    for token in vocab:
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            if left in vocab and right in vocab:
                merges.append((rank(token), vocab[left], vocab[right], left, right))
    return [(left, right) for *_, left, right in sorted(merges)]


def to_tokenizers(path: str):
    """The ``tokenizers.Tokenizer`` that encodes as the SentencePiece model at ``path`` (no BOS or EOS
    added, as meshlm's SentencePiece tokenizers; control pieces in the text are plain text when
    the caller sets ``encode_special_tokens``, as transformers' ``split_special_tokens`` does)."""
    import sentencepiece
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers

    spec = model_spec(path)
    why = ("it is a word or character model" if spec["model_type"] not in (_UNIGRAM, _BPE) else
           "it treats whitespace as a suffix" if spec["suffix"] else
           "it does not escape whitespace" if not spec["escape_spaces"] else None)
    if why:
        raise DataError(f"{path}: no tokenizer.json equivalent ({why})")
    sp = sentencepiece.SentencePieceProcessor(model_file=path)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    byte_fallback = any(sp.is_byte(i) for i in range(len(pieces)))
    unk = sp.unk_id()
    if spec["model_type"] == _UNIGRAM:
        model = models.Unigram([(p, sp.get_score(i)) for i, p in enumerate(pieces)], unk, byte_fallback)
    else:
        vocab = {p: i for i, p in enumerate(pieces)}
        normal = {p: i for p, i in vocab.items() if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))}
        model = models.BPE(vocab, ranked_merges(normal, lambda p: -sp.get_score(vocab[p])),
                           unk_token=pieces[unk], fuse_unk=True, byte_fallback=byte_fallback)
    tok = Tokenizer(model)
    steps = [normalizers.Precompiled(spec["charsmap"])] if spec["charsmap"] else []
    if spec["squeeze_spaces"]:
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex("^ | $"), "")]
    steps += [normalizers.Prepend(" ")] if spec["dummy_prefix"] else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if spec["dummy_prefix"] else []))
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for i, p in enumerate(pieces)
                            if sp.is_control(i) or sp.is_unknown(i)])
    tok.add_tokens([AddedToken(pieces[i], special=False, normalized=False) for i in spec["user_defined"]])
    return tok

