"""The shipped demo model's data and its evaluation: the corpus it was trained on (with the held-out split,
corpus.py) and the held-out questions with their judge (evaluate.py). scripts/train_demo_model.py trains from
them, scripts/eval_demo_model.py and `pagedchat bench accuracy` ask the questions."""
