"""How good the warmed-up models are before RL: plays the review chain's episodes offline
with transformers `generate` (no FlexMARL run) and prints each agent's mean reward, greedy
and sampled at temperature 1. RL has room where the sampled reward is well below 1.

    python examples/review_chain/measure_warmup.py SOLVER_DIR VERIFIER_DIR [--rows data/eval.jsonl]
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from review_task import EVAL_FILE, read_rows, review_request, solver_reward, verifier_reward


class Agent:
    def __init__(self, model_dir: str) -> None:
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def reply(self, messages: list[dict], temperature: float, max_tokens: int = 10) -> tuple[str, int]:
        """The decoded reply and how many tokens it took (EOS included)."""
        prompt = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([self.tok.encode(prompt, add_special_tokens=False)])
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {"do_sample": False}
        with torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=max_tokens, eos_token_id=self.tok.eos_token_id,
                                      pad_token_id=self.tok.pad_token_id, **sampling)[0, ids.shape[1]:]
        return self.tok.decode(out, skip_special_tokens=True), len(out)


def play(solver: Agent, verifier: Agent, row: dict, temperature: float) -> tuple[float, float, int]:
    """One episode: (solver reward, verifier reward, tokens the first answer took)."""
    chat = [{"role": "user", "content": row["question"]}]
    first, length = solver.reply(chat, temperature)
    said, _ = verifier.reply([{"role": "user", "content": review_request(row["question"], first)}], temperature)
    final, _ = solver.reply(chat + [{"role": "assistant", "content": first}, {"role": "user", "content": said}],
                            temperature)
    return solver_reward(first, final, row["answer"]), verifier_reward(said, first, row["answer"]), length


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("solver")
    parser.add_argument("verifier")
    parser.add_argument("--rows", type=Path, default=EVAL_FILE)
    parser.add_argument("--repeats", type=int, default=5, help="sampled episodes per row")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    solver, verifier = Agent(args.solver), Agent(args.verifier)
    rows = read_rows(args.rows)
    for temperature, repeats in ((0.0, 1), (1.0, args.repeats)):
        results = [play(solver, verifier, row, temperature) for row in rows for _ in range(repeats)]
        n = len(results)
        print(f"T={temperature:g}: solver {sum(r[0] for r in results) / n:.3f}  "
              f"verifier {sum(r[1] for r in results) / n:.3f}  "
              f"first-answer tokens {min(r[2] for r in results)}..{max(r[2] for r in results)} "
              f"({n} episodes, {args.rows.name})")


if __name__ == "__main__":
    main()
