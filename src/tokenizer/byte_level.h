// GPT-2's byte-level alphabet (bytes_to_unicode in OpenAI's encoder.py): every byte gets a
// printable code point so that vocab.json / merges.txt can store arbitrary bytes as text.
// Printable Latin-1 bytes ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF) stand for themselves; the
// other 68 bytes, in increasing order, get U+0100, U+0101, ... .
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace k3::tok {

// Code point that stands for byte b.
uint32_t byte_to_unicode(uint8_t b);

// Raw bytes of a byte-level string (UTF-8 text of alphabet characters); nullopt if it holds a
// character outside the alphabet or is not valid UTF-8.
std::optional<std::string> byte_level_decode(std::string_view text);

// The byte-level UTF-8 text for raw bytes.
std::string byte_level_encode(std::string_view bytes);

// Standard base64 (RFC 4648, with padding) to bytes; "" if `text` is not base64 (tiktoken files).
std::string base64_decode(std::string_view text);

// Raw bytes shown for people in error messages: printable ASCII as is, the rest as \xNN.
std::string escape_bytes(std::string_view bytes, size_t max_len = 60);

}  // namespace k3::tok
