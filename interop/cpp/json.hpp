// A small JSON value, parser and writer: enough for the interop canonical-types file
// and the result lines (no dependency beyond the standard library).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace mini {

struct Json {
    enum Kind { NUL, BOOL, NUMBER, STRING, ARRAY, OBJECT };
    Kind kind = NUL;
    bool b = false;
    double num = 0;
    std::string str;                                   // STRING, and the text of a NUMBER
    std::vector<Json> arr;
    std::vector<std::pair<std::string, Json>> obj;     // insertion order kept

    Json() {}
    static Json null() { return Json(); }
    static Json boolean(bool v) { Json j; j.kind = BOOL; j.b = v; return j; }
    static Json number(double v) {
        Json j; j.kind = NUMBER; j.num = v;
        char buf[64];
        if (std::floor(v) == v && std::fabs(v) < 9007199254740992.0) std::snprintf(buf, sizeof buf, "%.0f", v);
        else std::snprintf(buf, sizeof buf, "%.17g", v);
        j.str = buf;
        return j;
    }
    static Json string(const std::string& s) { Json j; j.kind = STRING; j.str = s; return j; }
    static Json array() { Json j; j.kind = ARRAY; return j; }
    static Json object() { Json j; j.kind = OBJECT; return j; }

    bool is_null() const { return kind == NUL; }
    bool has(const std::string& k) const {
        for (auto& p : obj) if (p.first == k) return true;
        return false;
    }
    const Json& operator[](const std::string& k) const {
        static const Json missing;
        for (auto& p : obj) if (p.first == k) return p.second;
        return missing;
    }
    Json& set(const std::string& k, Json v) {
        for (auto& p : obj) if (p.first == k) { p.second = std::move(v); return p.second; }
        obj.emplace_back(k, std::move(v));
        return obj.back().second;
    }
    Json& push(Json v) { arr.push_back(std::move(v)); return arr.back(); }
};

inline void put_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) out += char(cp);
    else if (cp < 0x800) { out += char(0xC0 | (cp >> 6)); out += char(0x80 | (cp & 0x3F)); }
    else if (cp < 0x10000) { out += char(0xE0 | (cp >> 12)); out += char(0x80 | ((cp >> 6) & 0x3F)); out += char(0x80 | (cp & 0x3F)); }
    else { out += char(0xF0 | (cp >> 18)); out += char(0x80 | ((cp >> 12) & 0x3F)); out += char(0x80 | ((cp >> 6) & 0x3F)); out += char(0x80 | (cp & 0x3F)); }
}

// The first code point of a UTF-8 string.
inline uint32_t first_code_point(const std::string& s) {
    if (s.empty()) return 0;
    unsigned char c = s[0];
    if (c < 0x80) return c;
    int n = c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : 1;
    uint32_t cp = c & (0x3F >> n);
    for (int i = 1; i <= n && i < (int)s.size(); i++) cp = (cp << 6) | (s[i] & 0x3F);
    return cp;
}

class Parser {
  public:
    explicit Parser(const std::string& text) : s_(text), i_(0) {}
    Json parse() {
        Json v = value();
        ws();
        if (i_ != s_.size()) fail("trailing characters");
        return v;
    }

  private:
    const std::string& s_;
    size_t i_;

    [[noreturn]] void fail(const std::string& why) {
        throw std::runtime_error("JSON: " + why + " at offset " + std::to_string(i_));
    }
    void ws() { while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) i_++; }
    bool lit(const char* w) {
        size_t n = std::char_traits<char>::length(w);
        if (s_.compare(i_, n, w) == 0) { i_ += n; return true; }
        return false;
    }
    Json value() {
        ws();
        if (i_ >= s_.size()) fail("unexpected end");
        char c = s_[i_];
        if (c == '{') {
            i_++;
            Json o = Json::object();
            ws();
            if (s_[i_] == '}') { i_++; return o; }
            while (true) {
                ws();
                if (s_[i_] != '"') fail("expected a key");
                std::string k = string();
                ws();
                if (s_[i_++] != ':') fail("expected ':'");
                o.obj.emplace_back(k, value());
                ws();
                if (s_[i_] == ',') { i_++; continue; }
                if (s_[i_] == '}') { i_++; return o; }
                fail("expected ',' or '}'");
            }
        }
        if (c == '[') {
            i_++;
            Json a = Json::array();
            ws();
            if (s_[i_] == ']') { i_++; return a; }
            while (true) {
                a.arr.push_back(value());
                ws();
                if (s_[i_] == ',') { i_++; continue; }
                if (s_[i_] == ']') { i_++; return a; }
                fail("expected ',' or ']'");
            }
        }
        if (c == '"') return Json::string(string());
        if (lit("true")) return Json::boolean(true);
        if (lit("false")) return Json::boolean(false);
        if (lit("null")) return Json::null();
        size_t start = i_;
        while (i_ < s_.size() && std::string("+-0123456789.eE").find(s_[i_]) != std::string::npos) i_++;
        if (start == i_) fail("unexpected character");
        Json n;
        n.kind = Json::NUMBER;
        n.str = s_.substr(start, i_ - start);
        n.num = std::strtod(n.str.c_str(), nullptr);
        return n;
    }
    uint32_t hex4() {
        if (i_ + 4 > s_.size()) fail("short \\u escape");
        uint32_t v = std::stoul(s_.substr(i_, 4), nullptr, 16);
        i_ += 4;
        return v;
    }
    std::string string() {
        i_++;  // opening quote
        std::string out;
        while (true) {
            if (i_ >= s_.size()) fail("unterminated string");
            char c = s_[i_++];
            if (c == '"') return out;
            if (c != '\\') { out += c; continue; }
            char e = s_[i_++];
            switch (e) {
            case '"': out += '"'; break;
            case '\\': out += '\\'; break;
            case '/': out += '/'; break;
            case 'b': out += '\b'; break;
            case 'f': out += '\f'; break;
            case 'n': out += '\n'; break;
            case 'r': out += '\r'; break;
            case 't': out += '\t'; break;
            case 'u': {
                uint32_t cp = hex4();
                if (cp >= 0xD800 && cp < 0xDC00 && s_.compare(i_, 2, "\\u") == 0) {
                    i_ += 2;
                    uint32_t lo = hex4();
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                }
                put_utf8(out, cp);
                break;
            }
            default: fail("bad escape");
            }
        }
    }
};

inline Json parse(const std::string& text) { return Parser(text).parse(); }

inline void dump_string(std::string& out, const std::string& s) {
    out += '"';
    for (unsigned char c : s) {
        switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        default:
            if (c < 0x20) { char buf[8]; std::snprintf(buf, sizeof buf, "\\u%04x", c); out += buf; }
            else out += char(c);
        }
    }
    out += '"';
}

inline void dump(std::string& out, const Json& j) {
    switch (j.kind) {
    case Json::NUL: out += "null"; break;
    case Json::BOOL: out += j.b ? "true" : "false"; break;
    case Json::NUMBER: out += j.str; break;
    case Json::STRING: dump_string(out, j.str); break;
    case Json::ARRAY:
        out += '[';
        for (size_t i = 0; i < j.arr.size(); i++) { if (i) out += ", "; dump(out, j.arr[i]); }
        out += ']';
        break;
    case Json::OBJECT:
        out += '{';
        for (size_t i = 0; i < j.obj.size(); i++) {
            if (i) out += ", ";
            dump_string(out, j.obj[i].first);
            out += ": ";
            dump(out, j.obj[i].second);
        }
        out += '}';
        break;
    }
}

inline std::string dump(const Json& j) { std::string s; dump(s, j); return s; }

}  // namespace mini
