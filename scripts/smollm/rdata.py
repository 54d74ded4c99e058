"""Reads character vectors out of an R lazy-load database (Rdata.rdx + Rdata.rdb).

Only what janeaustenr's data needs: XDR serialisation version 2/3 of lists, character,
integer, logical and double vectors, pairlists and symbols. Format facts from R's
serialize.c: each item starts with a 32-bit flags word (type in the low byte, bit 9 =
has attributes, bit 10 = has tag); the .rdx index is gzip-compressed and each .rdb
record is a 4-byte big-endian length, a compression byte ('Z' zlib, '2' bzip2, 'X' xz,
'0' none; plain zlib when the byte is absent) and the payload.
"""
import bz2
import gzip
import lzma
import struct
import zlib

NILVALUE, REFSXP, GLOBALENV, EMPTYENV, BASEENV = 254, 255, 253, 242, 241
SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 1, 2, 9, 10, 13, 14, 16, 19


class _Reader:
    def __init__(self, data):
        self.data, self.pos, self.refs = data, 0, []

    def take(self, n):
        if self.pos + n > len(self.data):
            raise ValueError("R serialisation truncated")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def int(self):
        return struct.unpack(">i", self.take(4))[0]

    def header(self):
        if self.take(2) != b"X\n":
            raise ValueError("not an XDR R serialisation")
        version = self.int()
        self.int(), self.int()
        if version == 3:
            self.take(self.int())  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported R serialisation version {version}")

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (NILVALUE, GLOBALENV, EMPTYENV, BASEENV):
            return None
        if kind == REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == SYMSXP:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == LISTSXP:
            attr = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            car = self.item()
            cdr = self.item()
            del attr
            return [(tag, car)] + (cdr or [])
        if kind == CHARSXP:
            n = self.int()
            return None if n == -1 else self.take(n).decode("utf-8", errors="replace")
        if kind in (LGLSXP, INTSXP):
            n = self.int()
            value = list(struct.unpack(f">{n}i", self.take(4 * n)))
        elif kind == REALSXP:
            n = self.int()
            value = list(struct.unpack(f">{n}d", self.take(8 * n)))
        elif kind in (STRSXP, VECSXP):
            value = [self.item() for _ in range(self.int())]
        else:
            raise ValueError(f"unsupported R object type {kind}")
        if has_attr:
            attrs = dict(self.item() or [])
            if "names" in attrs and kind == VECSXP:
                return dict(zip(attrs["names"], value))
        return value


def _unserialize(data):
    reader = _Reader(data)
    reader.header()
    return reader.item()


def _record(blob):
    length = struct.unpack(">I", blob[:4])[0]
    kind, payload = blob[4:5], blob[5:]
    if kind == b"Z":
        out = zlib.decompress(payload)
    elif kind == b"2":
        out = bz2.decompress(payload)
    elif kind == b"X":
        out = lzma.decompress(payload)
    elif kind == b"0":
        out = payload
    else:
        out = zlib.decompress(blob[4:])
    if len(out) != length:
        raise ValueError("R lazy-load record has the wrong length")
    return out


def load(rdx_path, rdb_path):
    """Returns {variable name: value} for every variable of the database."""
    with gzip.open(rdx_path, "rb") as f:
        index = _unserialize(f.read())
    with open(rdb_path, "rb") as f:
        rdb = f.read()
    out = {}
    for name, (offset, length) in index["variables"].items():
        out[name] = _unserialize(_record(rdb[offset:offset + length]))
    return out
