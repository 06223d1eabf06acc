"""Text to train an EAGLE-3 head on: the model's own answers to general questions that no benchmark asks.

Three steps (the answers come from `forerun run`, which is exact: they are what plain generate writes; stop it
when you have enough, it resumes where it stopped):

    .venv/bin/python benchmarks/head_corpus.py questions --count 3200 --out heads/questions.jsonl
    .venv/bin/forerun run heads/questions.jsonl --out heads/answers.jsonl --method auto --batch-size 16 \
        --threads 2 --dtype bf16 --max-new-tokens 160                          # ~30 answers a minute, 2 cores
    .venv/bin/python benchmarks/head_corpus.py corpus --answers heads/answers.jsonl --questions heads/questions.jsonl \
        --stdlib-tokens 60000 --out heads/corpus.jsonl
    .venv/bin/forerun train-head --corpus heads/corpus.jsonl --unroll 3 --minutes 48 --threads 2 --out heads/smollm2

With more answers later, `forerun train-head ... --start-from heads/smollm2` trains that head further (the shipped
head: two runs, 48 and 35 minutes; the benchmarks page, "EAGLE-3").

Each corpus row is the chat-templated question followed by the answer (what the head sees when it drafts a chat
answer), then some of the Python standard library's sources (code, as the code benchmarks ask for).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

TOPICS = (
    "photosynthesis, the water cycle, compound interest, black holes, vaccines, the French Revolution, machine "
    "learning, the stock market, volcanoes, the immune system, climate change, the internet, democracy, inflation, "
    "gravity, DNA, renewable energy, the Roman Empire, sleep, coffee, meditation, electric cars, recycling, the moon "
    "landing, honeybees, rainbows, earthquakes, the printing press, cryptocurrency, tides, nutrition, exercise, "
    "public speaking, time management, learning a language, gardening, budgeting, cooking pasta, chess, painting, "
    "photography, job interviews, teamwork, friendship, travel, reading habits, remote work, mountains, oceans, "
    "deserts, rain forests, the Olympic Games, music theory, jazz, the human brain, memory, stress, cats, dogs, "
    "birds migrating, the solar system, Mars, electricity, magnets, bridges, airplanes, trains, bicycles, cities, "
    "farming, bread, tea, chocolate, friendship, kindness, history, the ancient Egyptians, the Renaissance, "
    "volunteering, saving money, writing a resume, a healthy breakfast, houseplants, the seasons, snow, wind power, "
    "solar panels, batteries, smartphones, social media, video games, board games, football, basketball, running, "
    "swimming, yoga, hiking, camping, fishing, baking cookies, pizza, rice, vegetables, fruit, vitamins, the heart, "
    "the lungs, bones, teeth, the eyes, hearing, dreams, habits, motivation, procrastination, creativity, curiosity, "
    "empathy, negotiation, leadership, customer service, marketing, starting a small business, taxes, insurance, "
    "renting an apartment, moving to a new city, packing for a trip, museums, libraries, newspapers, podcasts, movies, "
    "theater, poetry, novels, fairy tales, mythology, dinosaurs, fossils, evolution, cells, bacteria, viruses, "
    "antibiotics, the periodic table, atoms, light, sound, temperature, weather forecasts, hurricanes, lightning, "
    "glaciers, rivers, lakes, islands, maps, compasses, the calendar, clocks, money, banks, trade, ancient Greece, "
    "castles, knights, pirates, explorers, the Silk Road, the Great Wall of China, pyramids, robots, 3D printing, "
    "passwords, online safety, email etiquette, spreadsheets, programming, algorithms, databases, the cloud"
).split(", ")
TEMPLATES = (
    "Explain {t} to a ten-year-old.",
    "What are the main facts everyone should know about {t}?",
    "Give me three interesting points about {t}.",
    "Write a short paragraph about {t}.",
    "What are common misconceptions about {t}?",
    "How would you summarize {t} in a few sentences?",
    "Why is {t} important?",
    "Write a short poem about {t}.",
    "What are some tips related to {t}?",
    "Describe the history of {t} briefly.",
    "What should a beginner know about {t}?",
    "Write a short story that involves {t}.",
    "List the pros and cons of {t}.",
    "How does {t} affect everyday life?",
    "Write a friendly note to a friend about {t}.",
    "What questions do people often ask about {t}? Answer two of them.",
)


def questions(count: int = 320, seed: int = 0) -> list[dict]:
    """`forerun run` records: chat questions from topic x template, shuffled, none of the benchmark's own."""
    rows = [
        {"id": f"q{i}", "prompt": template.format(t=topic), "chat": True, "max_new_tokens": 160}
        for i, (topic, template) in enumerate(itertools.product(TOPICS, TEMPLATES))
    ]
    random.Random(seed).shuffle(rows)
    asked = {json.loads(line)["prompt"] for line in Path(__file__).with_name("chat_questions.jsonl").open()}
    return [row for row in rows if row["prompt"] not in asked][:count]


def corpus(answers: Path, asked: Path, stdlib_tokens: int) -> list[dict]:
    """Corpus rows {'text'}: each question chat-templated with its answer, then stdlib sources up to a budget."""
    from forerun.drafters.eagle3.train import stdlib_texts
    from forerun.models import load_model

    _, tokenizer = load_model("smollm2-135m")
    prompts = {row["id"]: row["prompt"] for row in map(json.loads, asked.open())}
    rows = []
    for answer in map(json.loads, answers.open()):
        asked_text = prompts[answer["id"]]
        messages = [{"role": "user", "content": asked_text}, {"role": "assistant", "content": answer["text"]}]
        rows.append({"text": tokenizer.apply_chat_template(messages, tokenize=False)})
    left = stdlib_tokens
    for text in stdlib_texts():
        if left <= 0:
            break
        rows.append({"text": text})
        left -= len(tokenizer(text)["input_ids"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["questions", "corpus"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--answers", type=Path, help="corpus: `forerun run`'s output")
    parser.add_argument("--questions", type=Path, help="corpus: the questions file those answer")
    parser.add_argument("--stdlib-tokens", type=int, default=60000)
    parser.add_argument("--count", type=int, default=320, help="questions: how many")
    args = parser.parse_args()
    if args.what == "questions":
        rows = questions(args.count)
    else:
        rows = corpus(args.answers, args.questions, args.stdlib_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
