"""Draft training: an EAGLE-3 or EAGLE draft for any Llama-family target tandem loads (`tandem train-draft`).

data.py (prompts, self-distilled rows, batches by step), vocab.py (EAGLE-3's reduced vocabulary),
heads.py (the trainable heads, published keys), ttt.py (training-time test against the frozen
target run by tandem's provider), trainer.py (the resumable loop and `train_draft`), checkpoint.py
(the published layout and the trainer state). The demo trainer (`tandem.demo`) shares the heads,
the TTT math and the loop.
"""
