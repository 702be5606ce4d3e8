// The reference encoders: prints the token ids of each FILE (read as UTF-8, as Node reads it) as one JSON
// array per line, by the npm package the trainer's tokenizer matches (scripts/fetch_tokenizers.sh installs
// them). With --time, prints instead the seconds spent encoding (reading excluded), for
// scripts/bench_tokenizers.sh.
// Usage: node dev/tokenize_npm.js gpt2|cl100k|dolma2 [--time] FILE...
"use strict";
const path = require("path");
const fs = require("fs");
const modules = path.join(__dirname, "..", "data", "tokenizers", "node_modules");
const [name, ...rest] = process.argv.slice(2);
const time = rest[0] === "--time";
const files = time ? rest.slice(1) : rest;
let encode;
if (name === "gpt2") {
    encode = require(path.join(modules, "gpt-3-encoder")).encode;
} else if (name === "cl100k") {
    const { Tiktoken } = require(path.join(modules, "js-tiktoken", "dist", "lite.cjs"));
    const ranks = require(path.join(modules, "js-tiktoken", "dist", "ranks", "cl100k_base.cjs"));
    const enc = new Tiktoken(ranks);
    encode = (text) => enc.encode(text);
} else if (name === "dolma2") {
    // OLMo-2's tokenizer as dolma applied it: cl100k_base and OLMo-2's added tokens (allenai_dolma2.json),
    // the non-special ones found in text (allowed), the special ones' text encoded as text (none disallowed).
    const { Tiktoken } = require(path.join(modules, "js-tiktoken", "dist", "lite.cjs"));
    const ranks = require(path.join(modules, "js-tiktoken", "dist", "ranks", "cl100k_base.cjs"));
    const matched = { "<|extra_id_0|>": 100256, "|||PHONE_NUMBER|||": 100261, "|||EMAIL_ADDRESS|||": 100262,
                      "|||IP_ADDRESS|||": 100263 };
    for (let i = 1; i <= 10; ++i) matched[`<|extra_id_${i}|>`] = 100265 + i;
    const enc = new Tiktoken(ranks, matched);
    const allowed = Object.keys(matched);
    encode = (text) => enc.encode(text, allowed, []);
} else {
    console.error(`usage: node ${process.argv[1]} gpt2|cl100k|dolma2 [--time] FILE...`);
    process.exit(2);
}
const texts = files.map((f) => fs.readFileSync(f, "utf8"));
const t0 = process.hrtime.bigint();
const out = texts.map((t) => encode(t));
const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
if (time) {
    console.log(JSON.stringify({ seconds, tokens: out.reduce((n, ids) => n + ids.length, 0) }));
} else {
    for (const ids of out) console.log(JSON.stringify(ids));
}
