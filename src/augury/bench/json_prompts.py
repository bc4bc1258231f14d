"""`augury bench --prompts json`: chat prompts that ask for JSON, each with the schema augury's systems
constrain its answer to (response_format json_schema, strict). The schemas are augury's own and held
out (no training template asks for JSON): nested objects, bounded arrays, enums, bounded numbers,
booleans and bounded strings, as clients send them."""
from __future__ import annotations

import json

_NAME = {"type": "string", "maxLength": 40}

# --prompts json's default --output-len: room for every answer to end where its JSON does (the demo's
# longest greedy answer to these tasks is 154 tokens); at the bench's general default of 64, five of the
# eight answers were cut short, and a JSON answer cut short is not JSON (nor the workload people run)
JSON_OUTPUT_LEN = 512

JSON_TASKS: list[tuple[str, dict]] = [
    ("Invent a person and describe them as JSON: name, age, home city and up to three hobbies.",
     {"type": "object", "required": ["name", "age", "city", "hobbies"], "properties": {
         "name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": _NAME,
         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3}}}),
    ("Give the weather forecast for Lisbon for the next three days as JSON.",
     {"type": "object", "required": ["city", "unit", "days"], "properties": {
         "city": _NAME, "unit": {"enum": ["celsius", "fahrenheit"]},
         "days": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
             "type": "object", "required": ["day", "high", "low", "rain"], "properties": {
                 "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]},
                 "high": {"type": "integer", "minimum": -40, "maximum": 50},
                 "low": {"type": "integer", "minimum": -40, "maximum": 50}, "rain": {"type": "boolean"}}}}}}),
    ("Write a short recipe for pancakes as JSON with a title, servings, ingredients and steps.",
     {"type": "object", "required": ["title", "servings", "ingredients", "steps"], "properties": {
         "title": _NAME, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
         "ingredients": {"type": "array", "minItems": 2, "maxItems": 6, "items": {
             "type": "object", "required": ["item", "grams"], "properties": {
                 "item": {"type": "string", "maxLength": 30}, "grams": {"type": "integer", "minimum": 1,
                                                                        "maximum": 1000}}}},
         "steps": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "string", "maxLength": 80}}}}),
    ("Describe a book you would recommend, as JSON.",
     {"type": "object", "required": ["title", "author", "year", "genre", "rating", "in_print"], "properties": {
         "title": _NAME, "author": _NAME, "year": {"type": "integer", "minimum": 1500, "maximum": 2030},
         "genre": {"enum": ["fiction", "mystery", "science", "history", "poetry", "biography"]},
         "rating": {"type": "number", "minimum": 0, "maximum": 5}, "in_print": {"type": "boolean"}}}),
    ("Make up an online order with a customer and a few items, as JSON.",
     {"type": "object", "required": ["order_id", "customer", "items", "express"], "properties": {
         "order_id": {"type": "integer", "minimum": 1, "maximum": 999999},
         "customer": {"type": "object", "required": ["name", "email"], "properties": {
             "name": _NAME, "email": {"type": "string", "maxLength": 60}}},
         "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
             "type": "object", "required": ["sku", "quantity", "price"], "properties": {
                 "sku": {"type": "string", "maxLength": 12}, "quantity": {"type": "integer", "minimum": 1,
                                                                          "maximum": 20},
                 "price": {"type": "number", "minimum": 0, "maximum": 10000}}}},
         "express": {"type": "boolean"}}}),
    ("Plan a meeting next week and give it as a JSON calendar event.",
     {"type": "object", "required": ["title", "start_hour", "duration_minutes", "attendees", "remote"],
      "properties": {
          "title": _NAME, "start_hour": {"type": "integer", "minimum": 8, "maximum": 18},
          "duration_minutes": {"enum": [15, 30, 45, 60, 90]},
          "attendees": {"type": "array", "minItems": 1, "maxItems": 5, "items": _NAME},
          "remote": {"type": "boolean"}}}),
    ("Describe a used car for sale as JSON.",
     {"type": "object", "required": ["make", "model", "year", "mileage_km", "fuel", "features"], "properties": {
         "make": _NAME, "model": _NAME, "year": {"type": "integer", "minimum": 1980, "maximum": 2026},
         "mileage_km": {"type": "integer", "minimum": 0, "maximum": 500000},
         "fuel": {"enum": ["petrol", "diesel", "electric", "hybrid"]},
         "features": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 30}}}}),
    ("Report the status of three web servers as JSON.",
     {"type": "object", "required": ["servers", "healthy"], "properties": {
         "servers": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
             "type": "object", "required": ["host", "cpu_percent", "up", "region"], "properties": {
                 "host": {"type": "string", "maxLength": 30},
                 "cpu_percent": {"type": "number", "minimum": 0, "maximum": 100}, "up": {"type": "boolean"},
                 "region": {"enum": ["eu-west", "us-east", "ap-south"]}}}},
         "healthy": {"type": "boolean"}}}),
]


def json_chat_prompts(tokenizer, count: int) -> tuple[list[list[int]], list[str]]:
    """count prompts (the tasks in turn) through the chat template, and each one's schema as JSON text.
    The schema is also in the prompt, as a client asking for JSON would put it."""
    prompts, schemas = [], []
    for i in range(count):
        task, schema = JSON_TASKS[i % len(JSON_TASKS)]
        text = f"{task} Answer with JSON only, following this schema: {json.dumps(schema)}"
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        prompts.append(tokenizer.encode(rendered, add_special_tokens=False))
        schemas.append(json.dumps(schema))
    return prompts, schemas
