#pragma once

// Private: a second encoding of the envelope for the messages most calls
// send, read and written without protobuf's serializer and parser.

#include <cstddef>
#include <string>

namespace torchrpc {
namespace rpc {

namespace wire {
class Envelope;
} // namespace wire

namespace detail {

// Note [Compact envelopes]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Background: a one-element call's envelope is a few dozen bytes, yet
// protobuf's serializer and parser, with the size pass and the per-field
// dispatch they make, cost about 2.3 k instructions per side of a round trip
// (bench/RESULTS.md, "Where the remaining instructions go"). Most envelopes
// are flat: scalars, a body, a few metadata entries, dense tensor
// descriptors and values that are none, bool, int, double, bytes or a
// tensor. Those travel in a fixed little-endian layout that is filled and
// read field by field:
//
//   u8  0 (the marker: no protobuf message starts with a zero byte, since
//        field number 0 is invalid)
//   u32 version   u8 flags (1 is_response, 2 traced; no other bit)
//   u32 kind   u64 id   i64 from_worker   u64 timeout_ms
//   u32 body length, body
//   u8  metadata entries; each: u8 key length, key (printable ASCII, unique),
//       u32 value length, value
//   u8  tensor descriptors; each: u8 dtype, u8 requires_grad (0 or 1),
//       i32 device_type, i32 device_index, u8 dimensions, i64 per dimension
//   u8  values; each: u8 tag (1 none, 2 bool, 3 int, 4 double, 5 bytes,
//       6 tensor index), then u8 (0 or 1), i64, f64, u32 length and bytes,
//       or u32
//
// The header ends exactly after the last value. Anything else (a status, a
// sparse descriptor, a container or extension value, a field over its width,
// a field this build does not know) is sent as protobuf, and a receiver reads
// both: the marker says which. A header is wider this way (fixed widths, 8
// bytes a dimension); one over the codec's header cap is sent as protobuf
// before the cap refuses it.
//
// Guarantees:
//  1. Reading a compact envelope yields exactly the envelope that was
//     written, field by field and bit for bit (a double's sign and NaN
//     payload included); a value, descriptor or status that does not fit is
//     never narrowed: the writer declines it.
//  2. The reader trusts nothing: every length is checked against the bytes
//     left before it is used, counts are single bytes, unknown flags and
//     tags, a boolean other than 0 or 1, a repeated or non-printable
//     metadata key and trailing bytes are refused. What it allocates is
//     proportional to the header's own size, which the codec caps before
//     reading.
//  3. What the envelope means is checked where it always was: the codec's
//     version check and its value decoder see the same envelope either way.

// Writes `envelope` compactly into *out and returns true, or returns false
// (leaving *out unspecified) when it does not fit the layout above.
bool writeCompactEnvelope(const wire::Envelope& envelope, std::string* out);

// True when `bytes` starts with the compact marker.
inline bool isCompactEnvelope(const std::string& bytes) {
  return !bytes.empty() && bytes[0] == '\0';
}

// Parses a compact envelope into *envelope, which must be empty. False for
// anything that is not one, per Guarantee 2.
bool readCompactEnvelope(
    const char* data,
    size_t size,
    wire::Envelope* envelope);

} // namespace detail
} // namespace rpc
} // namespace torchrpc
